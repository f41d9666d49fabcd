"""The engine's scheduling wing: requests and their sampling parameters (``request``), the one ``Scheduler`` for
every role (``scheduler``) over the request allocator (``allocator``), what ranks agree on (``agreement``),
token choice (``sampling``) and the tiers below the device (``tiered``). It decides what each step computes;
it never runs a model."""
