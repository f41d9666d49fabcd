"""The engine's scheduling wing: requests, their status and sampling parameters (``request``), the one ``Scheduler``
for every role (``scheduler``) over the requests' KV façade (``kv``), what ranks agree on (``agreement``),
token choice (``sampling``) and the tiers below the device (``tiered``). It decides what each step computes;
it never runs a model."""
