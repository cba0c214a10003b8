"""The token ids a generation engine needs from a model's configs: where a response ends, what pads
it, the image placeholder, and the tokens never drawn (the saved generation config's suppressed ones
and the model's placeholders: a response holding a placeholder would break the forward that re-reads it)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

PLACEHOLDER_IDS = ("image_token_id", "video_token_id", "audio_token_id")


@dataclass(frozen=True)
class SpecialTokens:
    eos_ids: tuple[int, ...]
    pad_token_id: int
    image_token_id: int | None
    never_generated: tuple[int, ...]
    bos_token_id: int | None = None

    @classmethod
    def of(cls, config: Any, saved: Any) -> SpecialTokens:
        """From a transformers model `config` and its saved generation config `saved`."""
        eos = saved.eos_token_id if saved.eos_token_id is not None else config.get_text_config().eos_token_id
        eos_ids = (eos,) if isinstance(eos, int) else tuple(eos)
        pad = saved.pad_token_id if saved.pad_token_id is not None else eos_ids[0]
        placeholders = [getattr(config, name, None) for name in PLACEHOLDER_IDS]
        never = sorted({*(saved.suppress_tokens or ()), *(t for t in placeholders if t is not None)})
        return cls(
            eos_ids=eos_ids,
            pad_token_id=int(pad),
            image_token_id=getattr(config, "image_token_id", None),
            never_generated=tuple(never),
            bos_token_id=saved.bos_token_id,
        )

    @classmethod
    def of_directory(cls, directory: str | Path) -> SpecialTokens:
        """From a model directory's config.json and generation_config.json (or the config's defaults)."""
        from transformers import AutoConfig, GenerationConfig

        config = AutoConfig.from_pretrained(directory)
        if (Path(directory) / "generation_config.json").is_file():
            saved = GenerationConfig.from_pretrained(directory)
        else:
            saved = GenerationConfig.from_model_config(config)
        return cls.of(config, saved)

    def generation_ids(self) -> dict[str, Any]:
        """The ids a transformers GenerationConfig takes (eos, pad, and bos when the model has one)."""
        ids: dict[str, Any] = {"eos_token_id": list(self.eos_ids), "pad_token_id": self.pad_token_id}
        if self.bos_token_id is not None:
            ids["bos_token_id"] = self.bos_token_id
        return ids
