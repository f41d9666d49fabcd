"""The engine's forward wing: a step's batch (``batch``), its context for the layers (``step``) and its pool I/O
(``pool_io``: one gather and one scatter per memory pool). It runs what the scheduler decided; it decides
nothing."""
