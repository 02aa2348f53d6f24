"""Model settings several tests share."""

DEEPSEEK_PARTS = [
    "model.attention=mla",
    "model.kv_lora_rank=32",
    "model.rope_head_dim=8",
    "model.q_lora_rank=24",
    "model.rope_interleave=true",
    "model.moe.router=sigmoid",
    "model.moe.balance=bias",
    "model.moe.groups=4",
    "model.moe.group_top_k=2",
    "model.moe.routed_scaling=2.5",
]
"""DeepSeek-V3's parts on ``configs/moe-tiny.yaml`` (8 experts): latent attention with interleaved rotary
pairs, a sigmoid router choosing among its 2 best of 4 groups, routed scaling and the loss-free bias."""
