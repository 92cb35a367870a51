"""One language model with a mixer per layer (hybrid patterns), named presets and a decode cache.

    from fastweight.models import LMConfig, LanguageModel
    model = LanguageModel(LMConfig.preset("tiny", mixer="gdn,swa"))
    logits = model(input_ids)                       # [B, T] -> [B, T, vocab]
    out = model.generate(input_ids, max_new_tokens=8)
"""

from fastweight.models.config import MIXERS, PRESETS, LMConfig
from fastweight.models.lm import Block, Cache, LanguageModel, sample_next

__all__ = ["MIXERS", "PRESETS", "Block", "Cache", "LMConfig", "LanguageModel", "sample_next"]
