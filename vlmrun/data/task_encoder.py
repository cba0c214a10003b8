"""Energon task encoders: cook -> encode with the family's processor -> batch, on Energon's hooks.

`ChatSftTaskEncoder` (recipe name `chat_sft`) yields groups of micro-batches packed for the trip to
the loader shard (`vlmrun.data.transport.PackedBatches`; the shard unpacks them into
`vlmrun.data.batch.Batch`es). Its validation twin `ChatSftValTaskEncoder` yields the encoded
samples (full conversation and prompt) for `vlmrun.data.loader.val_batches` to collate.
`ChatGrpoTaskEncoder` (`chat_grpo`) yields prompts only: the conversation up to the last answer,
left-padded into `PromptBatch`es with the reference answer (for the reward) and the question
template; GRPO validates like SFT (the same validation twin). Every hook
is `@stateless` (a pure function of its input), which is what lets Energon restore a shuffle buffer
or a group by re-reading samples. The one thing a batcher adds is counts (`SampleCounts`, per
micro-batch): its conversations cut to max_seq_len, and, on the first, the samples the shard's
`ErrorBudget` skipped in this process since the group before, so a group carries the drops that
happened while it was filled (the loader keeps a rebuilt group's counts from its saved state). `decoder = None`: samples reach the cooker as raw bytes, and the
cooker decodes images straight to uint8 (Energon's default decoder would make float tensors the
processor then rescales again: ~45% of the loader's time, docs/measurements.md).
"""

from __future__ import annotations

import dataclasses

import torch
from megatron.energon import DefaultTaskEncoder, Sample, edataclass, stateless

from vlmrun.config.families import family_spec
from vlmrun.data.batch import IGNORE_INDEX, SampleCounts
from vlmrun.data.chat_encoding import ConversationEncoder, Encoded, EncodedPrompt
from vlmrun.data.cookers import Conversation, decode_media, energon_cookers
from vlmrun.data.epoch_stages import build_exact_epochs
from vlmrun.data.epochs import filler_id
from vlmrun.data.error_budget import ErrorBudget
from vlmrun.data.transport import PackedBatches, PromptGroup, SlotPool, collate_packed


@edataclass
class EncodedSample(Sample):
    """Energon's view of one encoded sample (carries the restore key through the pipeline)."""

    encoded: Encoded


@edataclass
class EncodedValSample(Sample):
    encoded: Encoded
    prompt: EncodedPrompt
    #: Samples skipped just before this one (the validation set counts those before its last sample).
    dropped_before: int = 0


class ChatSftTaskEncoder(DefaultTaskEncoder):
    """Chat-template SFT encoding for any registered family; see `vlmrun.data.chat_encoding`."""

    # Our ErrorBudget is the only limit: Energon's per-stage "N failures in a row" check is off.
    __default_failure_tolerance__ = 0
    decoder = None

    def __init__(
        self,
        *,
        processor,
        family: str,
        cookers: list[str],
        max_seq_len: int,
        micro_batch_size: int = 1,
        answer_room: int = 0,
        pack_tokens: int | None = None,
    ):
        super().__init__()
        self.micro_batch_size = micro_batch_size
        #: Set by the loader before its workers fork (see `vlmrun.data.transport.SlotPool`).
        self.slot_pool: SlotPool | None = None
        #: The shard's error handler, set by the loader: the batcher takes its count of skipped samples.
        self.budget: ErrorBudget | None = None
        #: Samples of each loader worker's epoch, fillers included (vlmrun.data.epochs), set by the loader.
        self.epoch_samples: int | None = None
        self.cookers = energon_cookers(cookers)
        self.encoder = ConversationEncoder(
            processor, family_spec(family), max_seq_len, answer_room=answer_room, pack_tokens=pack_tokens
        )

    @stateless
    def encode_sample(self, sample: Conversation) -> EncodedSample:
        return EncodedSample.derive_from(sample, encoded=self.encoder.encode(sample))

    def filler(self, sample: EncodedSample, n: int) -> EncodedSample:
        """The n-th filler of an epoch (vlmrun.data.epochs): `sample` again with no labelled token."""
        key = filler_id(sample.encoded.key, n)
        labels = torch.full_like(sample.encoded.labels, IGNORE_INDEX)
        encoded = dataclasses.replace(sample.encoded, key=key, labels=labels, truncated=False)
        return EncodedSample.derive_from(sample, __key__=key, encoded=encoded)

    def build_train_datasets(self, *, datasets, worker_config, batch_size, virtual_epoch_length=0, **kwargs):
        """Energon's training pipeline with exact epochs (vlmrun.data.epoch_stages), or, without
        `epoch_samples` (a run of loader format 1: vlmrun.data.fingerprint), Energon's own;
        `get_train_dataset` calls it."""
        if self.epoch_samples is None:
            return super().build_train_datasets(
                datasets=datasets,
                worker_config=worker_config,
                batch_size=batch_size,
                virtual_epoch_length=virtual_epoch_length,
                **kwargs,
            )
        return build_exact_epochs(
            self,
            datasets=datasets,
            worker_config=worker_config,
            batch_size=batch_size,
            shuffle_buffer_size=kwargs.get("shuffle_buffer_size"),
            virtual_epoch_length=virtual_epoch_length,
            epoch_samples=self.epoch_samples,
        )

    @stateless
    def batch(self, samples: list[EncodedSample]) -> PackedBatches:
        """The samples of one transfer group as micro-batches of `micro_batch_size`, packed (see transport)."""
        size = self.micro_batch_size
        groups = [[s.encoded for s in samples[i : i + size]] for i in range(0, len(samples), size)]
        packed = collate_packed(self.encoder, groups, self.slot_pool)
        packed.counts = self._counts([sum(e.truncated for e in g) for g in groups])
        return packed

    def _counts(self, truncated: list[int]) -> list[SampleCounts]:
        """Per micro-batch: its samples cut to max_seq_len; the first also the samples skipped since the
        group before."""
        dropped = self._take_skipped()
        return [SampleCounts(dropped=dropped if i == 0 else 0, truncated=n) for i, n in enumerate(truncated)]

    def _take_skipped(self) -> int:
        return self.budget.take_skipped() if self.budget is not None else 0


class ChatSftValTaskEncoder(ChatSftTaskEncoder):
    """Validation: each sample encoded twice (full conversation, prompt); `batch` keeps the list, so
    the caller can cut the stream at any sample count before collating."""

    @stateless
    def encode_sample(self, sample: Conversation) -> EncodedValSample:
        decode_media(sample)  # the full conversation and the prompt use the same pixels: decode them once
        encoded, prompt = self.encoder.encode(sample), self.encoder.encode_prompt(sample)
        return EncodedValSample.derive_from(sample, encoded=encoded, prompt=prompt, dropped_before=self._take_skipped())

    @stateless
    def batch(self, samples: list[EncodedValSample]) -> list[EncodedValSample]:
        return list(samples)


@edataclass
class EncodedPromptSample(Sample):
    prompt: EncodedPrompt


class ChatGrpoTaskEncoder(ChatSftTaskEncoder):
    """GRPO prompts: each sample's prompt with the template's generation prompt, and its answer."""

    @stateless
    def encode_sample(self, sample: Conversation) -> EncodedPromptSample:
        return EncodedPromptSample.derive_from(sample, prompt=self.encoder.encode_prompt(sample))

    def filler(self, sample: EncodedPromptSample, n: int) -> EncodedPromptSample:
        """The n-th filler of an epoch: the prompt again, under an id whose responses count for nothing."""
        key = filler_id(sample.prompt.key, n)
        return EncodedPromptSample.derive_from(sample, __key__=key, prompt=dataclasses.replace(sample.prompt, key=key))

    @stateless
    def batch(self, samples: list[EncodedPromptSample]) -> PromptGroup:
        """The samples of one transfer group as prompt micro-batches of `micro_batch_size`."""
        size = self.micro_batch_size
        prompts = [s.prompt for s in samples]
        batches = [self.encoder.collate_prompts(prompts[i : i + size]) for i in range(0, len(prompts), size)]
        return PromptGroup(batches=batches, counts=self._counts([0] * len(batches)))


# Names as declared in `vlmrun.data.components.TASK_ENCODERS` (tests/test_data_families.py checks).
_ENCODERS = {
    "chat_sft": (ChatSftTaskEncoder, ChatSftValTaskEncoder),
    "chat_grpo": (ChatGrpoTaskEncoder, ChatSftValTaskEncoder),
}


def task_encoder_of(recipe, processor, *, val: bool = False):
    """The recipe's task encoder (`data.task_encoder`, its training or validation variant) over
    `processor`: the one way the loader, the validation set and the data check build it.

    Training: micro-batches of `train.micro_batch_size`, packed into rows of `data.pack_tokens` when
    set (data/packing.py). Validation: a GRPO run's conversations may be `grpo.max_new_tokens` longer
    than their prompts (`answer_room`, see vlmrun.data.chat_encoding: its answers are responses).
    """
    d = recipe.data
    if val:
        answer_room = recipe.grpo.max_new_tokens if recipe.train.algorithm == "grpo" else 0
        options = {"answer_room": answer_room}
    else:
        options = {"micro_batch_size": recipe.train.micro_batch_size}
        if d.pack_tokens is not None:
            options["pack_tokens"] = d.pack_tokens
    cls = _ENCODERS[d.task_encoder][1 if val else 0]
    return cls(processor=processor, family=recipe.family, cookers=d.cookers, max_seq_len=d.max_seq_len, **options)
