"""The field registry: every field that crosses the data plane, named once.

Each field says how it is aligned and its dtype; which stage writes it and which stages read it is
the algorithm's to say (GRPO: algorithms/grpo/fields.py; SFT v2: micro_batches.py), in the
`PartitionSpec` of a partition: a stage asks the plane for exactly the fields the spec gives it, never
for "all". Light on purpose (no torch): recipes and tests read it without loading the stack.

1. Alignment. `SAMPLE`: one tensor per sample whose number of dimensions the field fixes (a scalar
   reward, an SFT micro-batch's padded ids). `PROMPT_TOKEN` / `RESPONSE_TOKEN`: a 1-D tensor per
   sample with one entry per prompt / response token; the plane checks that every field of one kind
   has the same length for a sample. `MEDIA`: a sample's packed media, a list of segments (one per
   image or per processor call, any shape), flattened on the wire with their shapes in the tags.
2. dtype is a torch dtype name, or "policy" for pixel values: floating, cast to the policy dtype before
   the wire (the plane's `pixel_dtype`).
3. Sync GRPO's fields: the rollout's prompts, responses, masks, generation logprobs, rewards and
   media, the logprob stage's prev and ref logprobs, the advantages.
4. SFT v2's record of a micro-batch: its padded tensors as `SAMPLE` fields (`batch_*`) and its packed
   media as one segment per media field.
5. A family's own inputs (config/families.py): its processor's per-token inputs (and their padded SFT
   twins) and its packed media, each marked with the families whose processor makes it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from types import MappingProxyType

from vlmrun.config.families import FAMILIES, family_spec


class Alignment(StrEnum):
    SAMPLE = "sample"
    PROMPT_TOKEN = "prompt_token"
    RESPONSE_TOKEN = "response_token"
    MEDIA = "media"


#: The dtype of pixel values: floating, cast to the policy dtype before the wire.
POLICY_DTYPE = "policy"


@dataclass(frozen=True, kw_only=True)
class FieldSpec:
    """One field of the plane. `ndim` fixes a `SAMPLE` field's dimensions; `families` is None for
    every family, else the families whose processor makes the field."""

    name: str
    alignment: Alignment
    dtype: str
    doc: str
    ndim: int | None = None
    families: tuple[str, ...] | None = None

    def for_family(self, family: str) -> bool:
        return self.families is None or family in self.families


def _grpo_fields() -> list[FieldSpec]:
    prompt, response, sample = Alignment.PROMPT_TOKEN, Alignment.RESPONSE_TOKEN, Alignment.SAMPLE
    fields = (  # name, alignment, dtype, what it holds
        ("prompt_ids", prompt, "int64", "the prompt's token ids (chat template, image placeholders expanded)"),
        ("response_ids", response, "int64", "the generated token ids"),
        ("response_mask", response, "bool", "the token mask of the response: True where a token counts in the loss"),
        (
            "generation_logprobs",
            response,
            "float32",
            "logprobs of the response tokens from the generation backend (token_mult_prob_error)",
        ),
        (
            "prev_logprobs",
            response,
            "float32",
            "logprobs of the response tokens under the policy before this step's update",
        ),
        (
            "ref_logprobs",
            response,
            "float32",
            "logprobs of the response tokens under the reference policy (KL penalty)",
        ),
        ("rewards", sample, "float32", "the reward of the response"),
        ("advantages", sample, "float32", "the group-normalized advantage of the response"),
    )
    return [
        FieldSpec(name=name, alignment=kind, dtype=dtype, doc=doc, ndim=0 if kind is sample else None)
        for name, kind, dtype, doc in fields
    ]


def _family_fields() -> list[FieldSpec]:
    """Per-token model inputs and packed media of every family (config/families.py)."""
    out: dict[str, FieldSpec] = {}
    for spec in FAMILIES.values():
        for key in spec.token_keys:
            fams = tuple(f.name for f in FAMILIES.values() if key in f.token_keys)
            out[key] = FieldSpec(
                name=key,
                alignment=Alignment.PROMPT_TOKEN,
                dtype="int64",
                families=fams,
                doc=f"the processor's per-token input {key} over the prompt",
            )
            out[f"batch_{key}"] = _sft_record(f"batch_{key}", f"the micro-batch's padded {key}", fams)
        for key in spec.media_keys:
            fams = tuple(f.name for f in FAMILIES.values() if key in f.media_keys)
            out[key] = FieldSpec(
                name=key,
                alignment=Alignment.MEDIA,
                dtype=POLICY_DTYPE if key == "pixel_values" else "int64",
                families=None if len(fams) == len(FAMILIES) else fams,
                doc=f"packed media {key}: one segment per image or processor call",
            )
    return list(out.values())


def _sft_record(name: str, doc: str, families: tuple[str, ...] | None = None) -> FieldSpec:
    return FieldSpec(name=name, alignment=Alignment.SAMPLE, dtype="int64", ndim=2, families=families, doc=doc)


def _sft_fields() -> list[FieldSpec]:
    return [
        _sft_record("batch_input_ids", "the micro-batch's right-padded input ids"),
        _sft_record("batch_attention_mask", "the micro-batch's attention mask"),
        _sft_record("batch_labels", "the micro-batch's labels (-100 where no loss)"),
    ]


FIELDS: MappingProxyType[str, FieldSpec] = MappingProxyType(
    {f.name: f for f in (*_grpo_fields(), *_sft_fields(), *_family_fields())}
)


def field_spec(name: str) -> FieldSpec:
    """The registry entry of `name`; `KeyError` naming the known fields."""
    try:
        return FIELDS[name]
    except KeyError:
        raise KeyError(f"unknown data-plane field {name!r}; known: {', '.join(sorted(FIELDS))}") from None


def media_fields(family: str) -> tuple[str, ...]:
    """The packed media fields of `family`."""
    return tuple(f.name for f in FIELDS.values() if f.alignment is Alignment.MEDIA and f.for_family(family))


def family_inputs(family: str) -> tuple[str, ...]:
    """The fields of `family`'s processor outputs as a sample carries them: its per-token inputs and its
    packed media, in registry order (InputError on model.family for an unknown family)."""
    spec = family_spec(family)
    return tuple(name for name in FIELDS if name in spec.token_keys or name in spec.media_keys)


def in_registry_order(fields) -> tuple[str, ...]:
    """`fields` (registry names), each once, in the order of the registry."""
    wanted = set(fields)
    return tuple(name for name in FIELDS if name in wanted)
