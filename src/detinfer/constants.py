"""Names and numbers several layers share, each stated once. Imports nothing (no torch, no Triton), so a
config, a CLI parser or a check can use them without loading the numerics.
"""

# The numerics modes: "deterministic" (batch-invariant kernels) and "fast" (the stock ones).
MODES = ("deterministic", "fast")

# The dtypes the kernels compute in, by HF's `torch_dtype` spelling (dtypes.py maps them to torch dtypes),
# and the engine's dtype setting: one of them, or "auto" (dtypes.resolve_dtype decides with the device).
DTYPE_NAMES = ("float32", "float16", "bfloat16")
ENGINE_DTYPES = ("auto", *DTYPE_NAMES)

# fp32 dots in the Triton kernels: full IEEE fp32 products, like torch's default (allow_tf32 off). tf32
# would be faster but loses 13 mantissa bits per product; 16-bit inputs ignore the setting.
FP32_DOT_PRECISION = "ieee"
LOW_DOT_PRECISION = "tf32"

# Keys per split of the attention kernels' deterministic key axis (splits anchored at key 0, merged in
# split order): part of the reduction order, so one number for every batch and schedule.
ATTENTION_SPLIT_SIZE = 256
# kv bound of the short decode CUDA graphs: exactly one split, so a short-KV decode takes the sequential
# schedule (no split-parallel merge) and its graph replays the eager step's bits.
SHORT_KV_TOKENS = ATTENTION_SPLIT_SIZE
