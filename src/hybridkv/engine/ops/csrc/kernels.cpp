// The engine's C++ CPU kernels as one translation unit: hybridkv.engine.ops.native builds this file only, so ATen's
// headers are parsed once (five files, each its own build: 3-7x the time of two on a busy 2-core machine). Each
// kernel stays in its own file, in a namespace of its own, and registers its operators there
// (TORCH_LIBRARY_FRAGMENT); the headers (numerics.h, gemv.h, gated.h, cells.h, paged.h) hold what they share.
#include "greedy.cpp"
#include "paged_decode.cpp"
#include "paged_spans.cpp"
#include "rms_norm.cpp"
#include "skinny_linear.cpp"
#include "gated_act.cpp"
#include "moe_decode.cpp"
#include "qk_rope.cpp"
#include "put_entries.cpp"
#include "band_attention.cpp"
#include "delta_chunks.cpp"
#include "gdn_decode.cpp"
#include "conv_decode.cpp"
#include "conv_prefill.cpp"
