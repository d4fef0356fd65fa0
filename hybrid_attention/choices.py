"""The choice lists every config, command line and op reads, in one torch-free module."""

LAYER_TYPES = ("kda", "mla")
RESIDUALS = ("standard", "attnres", "block_attnres")
BACKENDS = ("auto", "torch", "triton")  # the vocabulary of ops/backends.py
KDA_BACKENDS = (*BACKENDS, "fla")
ATTNRES_BACKENDS = BACKENDS
GATE_FORMS = ("bounded", "softplus", "head")  # the KDA decay gates (ops/kda/gate.py)
DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16")
OPTIMIZERS = ("adamw", "muon")
TOKENIZERS = ("byte", "bpe")
REPORTERS = ("tensorboard", "wandb")  # where training curves go besides log.jsonl
ACTIVATION_CHECKPOINTING = ("none", "mixer", "mlp", "all")  # which sublayers recompute their activations
FP8_RECIPES = ("tensorwise", "rowwise")  # torchao's float8 training scalings (training/fp8.py)
CARDS = ("h100", "h200")  # the cards `info --card` sizes a batch for (training/memory.py)
