"""Engine-neutral description of a model's layers, dtypes and parallel layout.

Every behaviour that depends on a layer's kind is written once, on the kind class
(``layers.py``) and its pool id (``pools.py``); memory, the planner, the prefix cache and
transfer ask them instead of branching on the class.

Checklist: adding a layer kind
1. A pool id, if no existing one has the kind's history rule: a frozen ``PoolId`` subclass
   with a new ``family`` (registered for ``PoolId.parse`` when the class is created; a taken
   family is refused), its ``id_space`` (``PAGE``: tokens on virtual pages; ``SLOT``: one
   state per request), ``rank`` (order among a shard's pools), ``param`` if parametrised,
   and the rule: ``first_needed(L)``, the first position the token at ``L - 1`` reads
   (elementwise on ints and int64 arrays; ``ModelSpec`` refuses a rule that breaks the
   invariants of ``pools.py``), and ``max_span``.
2. A kind class: a frozen dataclass subclassing ``LayerKind`` (or ``KVHeads`` for per-head
   K/V attention, which brings cell tensors, TP sharding and bytes) with ``tag``,
   ``pool_id``, ``cell_tensors`` (each with its ``tp_dim``), ``shard`` and
   ``recompute_flops_per_token``; exported here (``__all__``) with its pool id.
3. Presets: to load it from published records, its record kind name, section and reader in
   ``presets._KINDS``.
4. Hugging Face configs, which is what the engine serves (``engine_spec`` reads the model's
   config with ``from_hf_config``): a kind builder in ``hf_config.py``, its layer-type name
   in the ``kinds`` of each ``_ARCHITECTURE_TABLE`` entry whose configs use it, and the type
   and range of each config field it reads that is new (``hf_schema._FIELDS``).
Nothing else: memory builds the pool, sizing and the planner size it, views, release outside
the span and verify work from the pool id, and the engine's attention masks ask it too.
``tests/spec/test_new_kind.py`` walks this list with chunked-local attention.
"""

from hybridkv.catalogue import PresetError, preset_names, real_preset_names, tiny_preset_names
from hybridkv.spec.hf_config import HFConfigError, from_hf_config
from hybridkv.spec.layers import (
    MLA,
    CellTensor,
    FullAttention,
    KindTag,
    KVHeads,
    LayerKind,
    Linear,
    NoCache,
    SlidingWindow,
    StateTensor,
    dtype_name,
    parse_dtype,
)
from hybridkv.spec.model import Layer, ModelSpec
from hybridkv.spec.parallel import Parallel, ShardSpec
from hybridkv.spec.pools import (
    FULL_POOL,
    MLA_POOL,
    RECURRENT_POOL,
    FullPool,
    IdSpace,
    LatentPool,
    PoolId,
    PoolIdError,
    Positions,
    RecurrentPool,
    WindowPool,
)
from hybridkv.spec.presets import get_preset, published_record

__all__ = [
    "FULL_POOL",
    "MLA",
    "MLA_POOL",
    "RECURRENT_POOL",
    "CellTensor",
    "FullAttention",
    "FullPool",
    "HFConfigError",
    "IdSpace",
    "KVHeads",
    "KindTag",
    "LatentPool",
    "Layer",
    "LayerKind",
    "Linear",
    "ModelSpec",
    "NoCache",
    "Parallel",
    "PoolId",
    "PoolIdError",
    "Positions",
    "PresetError",
    "RecurrentPool",
    "ShardSpec",
    "SlidingWindow",
    "StateTensor",
    "WindowPool",
    "dtype_name",
    "from_hf_config",
    "get_preset",
    "parse_dtype",
    "preset_names",
    "published_record",
    "real_preset_names",
    "tiny_preset_names",
]
