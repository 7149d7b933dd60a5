"""Attention masks: descriptions (the zoo, user masks, combinations) and BlockMask, the
unified block-sparse storage format the kernels read. See docs/masks.md."""

from stof_cc.masks.block_mask import BlockMask
from stof_cc.masks.description import MaskDescription
from stof_cc.masks.errors import MaskError, MaskTypeError
from stof_cc.masks.geometry import EMPTY, FULL, PARTIAL
from stof_cc.masks.region import region
from stof_cc.masks.spec import parse_spec
from stof_cc.masks.user import from_dense, from_mask_mod, from_padding
from stof_cc.masks.zoo import (
    bigbird,
    causal,
    dilated,
    document,
    fixed,
    full,
    global_tokens,
    key_padding,
    longformer,
    random_blocks,
    sliding_window,
    strided,
)

__all__ = [
    "EMPTY",
    "FULL",
    "PARTIAL",
    "BlockMask",
    "MaskDescription",
    "MaskError",
    "MaskTypeError",
    "bigbird",
    "causal",
    "dilated",
    "document",
    "fixed",
    "from_dense",
    "from_mask_mod",
    "from_padding",
    "full",
    "global_tokens",
    "key_padding",
    "longformer",
    "parse_spec",
    "random_blocks",
    "region",
    "sliding_window",
    "strided",
]
