"""Maps layer: pure tensor functions, no hooks and no models.

Each file holds one method's formula; ``common`` holds what they share.
"""

from .common import HEAD_FUSIONS, dense_weight, fuse_heads, half_precision, last_query, mask_padding, propagate_query_row, query_rows, query_weights, real_tokens
from .common import zero_on_later_keys as is_causal
from .draws import hashed_draws, hashed_normal, real_ranks
from .interventions import erase_keys, on_heads, permute_rows, weigh_keys
from .context_mixing import (
    KeyTiles,
    LinearNorm,
    alti_contributions,
    alti_tile,
    head_vectors,
    key_tiles,
    logit_direction,
    logit_rollout,
    normalised_mixing,
    summed_weighted_norm,
    transformed_vectors,
    value_zeroing_distances,
    weighted_mixing,
)
from .encoder_decoder import encoder_decoder_relevance, encoder_decoder_rollout, without_self
from .effective import effective_attention, null_space_dims
from .flow import attention_flow_scores
from .grad_sam import grad_sam_head_mean, grad_sam_layer_maps, grad_sam_normalised, grad_sam_scores
from .knockout import knockout_head_sum, knockout_terms, segment_shares, with_decisive_tokens
from .raw import raw_attention_maps
from .rollout import add_residual, discard_lowest, rollout_layer_maps, rollout_scores
from .vision import patch_grid, reduced_keys_on_patch_grid, stage_keys_on_patch_grid, windows_on_patch_grid
from .transformer_attribution import relevance_head_mean, relevance_layer_maps, transformer_attribution_scores

__all__ = [
    "KeyTiles",
    "LinearNorm",
    "alti_contributions",
    "alti_tile",
    "head_vectors",
    "key_tiles",
    "logit_direction",
    "logit_rollout",
    "normalised_mixing",
    "transformed_vectors",
    "weighted_mixing",
    "HEAD_FUSIONS",
    "add_residual",
    "attention_flow_scores",
    "discard_lowest",
    "effective_attention",
    "encoder_decoder_relevance",
    "encoder_decoder_rollout",
    "erase_keys",
    "fuse_heads",
    "dense_weight",
    "half_precision",
    "is_causal",
    "grad_sam_head_mean",
    "grad_sam_layer_maps",
    "grad_sam_normalised",
    "grad_sam_scores",
    "hashed_draws",
    "hashed_normal",
    "knockout_head_sum",
    "knockout_terms",
    "last_query",
    "mask_padding",
    "null_space_dims",
    "on_heads",
    "patch_grid",
    "permute_rows",
    "propagate_query_row",
    "query_rows",
    "query_weights",
    "raw_attention_maps",
    "real_ranks",
    "real_tokens",
    "reduced_keys_on_patch_grid",
    "stage_keys_on_patch_grid",
    "relevance_head_mean",
    "relevance_layer_maps",
    "rollout_layer_maps",
    "rollout_scores",
    "segment_shares",
    "summed_weighted_norm",
    "transformer_attribution_scores",
    "value_zeroing_distances",
    "weigh_keys",
    "windows_on_patch_grid",
    "with_decisive_tokens",
    "without_self",
]
