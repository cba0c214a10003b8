"""Encode a `Conversation` with a model family's HF processor, and collate encodings into batches.

Shared by the Energon task encoder and the reference loader, so both produce identical tensors.

1. The text comes from the processor's chat template. Assistant spans are found by rendering: the
   span of assistant message i is what `messages[:i+1]` adds to `messages[:i]` rendered with the
   generation prompt, minus trailing whitespace. So the span holds the answer and its end-of-turn
   token, never the role header or a template's empty `<think></think>`; it works for templates
   without `{% generation %}` markers, and for Nemotron, whose processor breaks HF's assistant mask.
2. The rendered text is cut at span borders into pieces. Pieces with media go through the processor
   (it expands the placeholders and processes the images exactly once), text-only pieces through the
   tokenizer. Borders sit next to special tokens or a newline, where tokenization does not merge, so
   the concatenation is the tokenization of the whole text (tests/test_data_encoding.py checks it);
   a validation prompt is exactly the first piece.
3. Longer than `max_seq_len`: a conversation is cut at `max_seq_len` when the cut keeps every
   media token (the piece that holds the last image ends before it) and at least one labelled
   token (`Encoded.truncated`); a prompt is never cut. Otherwise the sample raises `SampleTooLong`,
   and the recipe's `data.on_bad_sample` decides (vlmrun.data.error_budget): refuse the run, or drop
   the sample, counted. Nothing is trained on without its image or without an answer token. A GRPO
   run's answers are responses, so its validation conversations have `grpo.max_new_tokens` more room
   (`answer_room`) than its prompts.
5. Every sample must also give the model what its forward checks: as many image placeholder tokens
   as its images have features (a text that spells the placeholder itself, e.g. `<|image_pad|>`,
   would otherwise stop the run at its first forward, "features and image tokens do not match"),
   and a conversation at least one labelled token. A sample that does not raises `SampleUnfit`
   (`kind`: media_mismatch, no_label; SampleTooLong's: too_long, media_cut) and follows
   `data.on_bad_sample` like an over-long one; `vlmrun data check` (vlmrun.data.check) counts them.
4. Media stay in the processor's packed form: per sample the rows of all its images and their grid
   sizes; a batch concatenates them in sample order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vlmrun.config.families import FamilySpec
from vlmrun.data.batch import IGNORE_INDEX, Batch, PromptBatch, media_into, media_layout
from vlmrun.data.cookers import Conversation, MalformedSample, media_pixels
from vlmrun.data.malloc import retain_freed_memory_in_worker
from vlmrun.data.packing import pack, packed_layout


@dataclass
class Encoded:
    """One encoded sample: 1-D `input_ids`/`labels`, per-token extras, packed media (may be empty).

    `truncated`: the conversation was cut at `max_seq_len` (its media and a labelled token kept);
    `media_end`: the tokens up to the end of the piece that holds its last image (0 without media).
    """

    key: str
    input_ids: torch.Tensor
    labels: torch.Tensor
    token_inputs: dict[str, torch.Tensor]
    media: dict[str, torch.Tensor]
    truncated: bool = False
    media_end: int = 0


@dataclass
class EncodedPrompt:
    """A prompt (everything before the last assistant answer) and the reference answer."""

    key: str
    input_ids: torch.Tensor
    token_inputs: dict[str, torch.Tensor]
    media: dict[str, torch.Tensor]
    answer: str
    template: str = ""  # the sample's question template, where its record names one (CLEVR)


class SampleUnfit(MalformedSample):
    """A well-formed sample that the run cannot train on as the recipe stands (module doc); it
    follows `data.on_bad_sample`. The message starts with its key; `kind` names the reason (`KINDS`)
    and `remedy` what the user can change."""

    KINDS = ("too_long", "media_cut", "no_label", "media_mismatch")

    def __init__(self, message: str, *, kind: str, remedy: str):
        super().__init__(message)
        self.kind, self.remedy = kind, remedy

    def __reduce__(self):  # an error that crosses processes (a loader worker's) is pickled
        return _rebuild_unfit, (type(self), str(self), self.kind, self.remedy)


def _rebuild_unfit(cls: type, message: str, kind: str, remedy: str) -> SampleUnfit:
    return cls(message, kind=kind, remedy=remedy)


_LONGER = "raise data.max_seq_len"


class SampleTooLong(SampleUnfit):
    """A sample that does not fit `data.max_seq_len` (module doc); the message starts with its key and
    gives its token count and the limit. `kind`: too_long (a prompt), media_cut (the cut would fall inside
    its media) or no_label (no answer token would be left)."""

    def __init__(self, message: str, *, kind: str = "too_long", remedy: str = _LONGER):
        super().__init__(message, kind=kind, remedy=remedy)


class ConversationEncoder:
    """Turns conversations into token ids, assistant-only labels and processed media.

    Holds the processor; not thread-safe (HF processors are not). Raises `MalformedSample` for a
    conversation the chat template cannot render consistently.
    """

    def __init__(
        self, processor, family: FamilySpec, max_seq_len: int, *, answer_room: int = 0, pack_tokens: int | None = None
    ):
        self.processor = processor
        self.pack_tokens = pack_tokens  # data.pack_tokens: collate packs into rows of it (data/packing.py)
        self.tokenizer = processor.tokenizer
        self.family = family
        self.max_seq_len = max_seq_len
        self.answer_room = answer_room  # a conversation may be this much longer than a prompt
        self.image_token = getattr(processor, "image_token", None)
        self._image_token_id = getattr(processor, "image_token_id", None)
        self._grid_key = next((k for k in family.media_keys if "grid" in k), None)
        self.pad_token_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0

    # ---- encoding -----------------------------------------------------------------------------
    def encode(self, conv: Conversation) -> Encoded:
        """The full conversation with labels on assistant spans, cut to `max_seq_len` where that keeps
        its media and a labelled token; raises `SampleTooLong` where it does not."""
        retain_freed_memory_in_worker()
        encoded = self._encode_messages(conv, conv.messages)
        labelled = (encoded.labels != IGNORE_INDEX).nonzero()
        if not labelled.numel():
            raise SampleUnfit(
                f"{conv.__key__}: no labelled token: no assistant turn has text the template renders",
                kind="no_label",
                remedy="give every conversation an assistant answer",
            )
        self._check_media_tokens(conv.__key__, encoded.input_ids, encoded.media)
        n, limit = encoded.input_ids.numel(), self.max_seq_len + self.answer_room
        if n <= limit:
            return encoded
        room = f" + grpo.max_new_tokens={self.answer_room}" if self.answer_room else ""
        too_long = f"{conv.__key__}: {n} tokens, more than data.max_seq_len={self.max_seq_len}{room}"
        if encoded.media_end > limit:
            raise SampleTooLong(
                f"{too_long}; its image would be cut (its prompt with the image takes {encoded.media_end})",
                kind="media_cut",
            )
        first_label = int(labelled[0])
        if first_label >= limit:
            raise SampleTooLong(
                f"{too_long}; no answer token would be left (the prompt takes {first_label})", kind="no_label"
            )
        return Encoded(
            key=encoded.key,
            input_ids=encoded.input_ids[:limit],
            labels=encoded.labels[:limit],
            token_inputs={k: v[:limit] for k, v in encoded.token_inputs.items()},
            media=encoded.media,
            truncated=True,
            media_end=encoded.media_end,
        )

    def encode_prompt(self, conv: Conversation) -> EncodedPrompt:
        """Prompt for generation (with the template's generation prompt) and the reference answer; a
        prompt longer than `max_seq_len` raises `SampleTooLong` (it is never cut)."""
        retain_freed_memory_in_worker()
        prompt = conv.messages[:-1] if conv.messages[-1]["role"] == "assistant" else conv.messages
        text = self._render(prompt, generation_prompt=True)
        images = self._images_of(conv, prompt)
        self._check_placeholders(conv.__key__, text, len(images))
        ids, tokens, media = self._process(text, images, first=True)
        self._check_media_tokens(conv.__key__, ids, media)
        if ids.numel() > self.max_seq_len:
            with_media = " (its image included)" if media else ""
            raise SampleTooLong(
                f"{conv.__key__}: its prompt has {ids.numel()} tokens{with_media}, more than "
                f"data.max_seq_len={self.max_seq_len}"
            )
        return EncodedPrompt(
            key=conv.__key__,
            input_ids=ids,
            token_inputs=tokens,
            media=media,
            answer=conv.answer,
            template=conv.annotations.get("template", ""),
        )

    def _encode_messages(self, conv: Conversation, messages: list[dict]) -> Encoded:
        text, spans = self._render_with_spans(conv.__key__, messages)
        images = self._images_of(conv, messages)
        self._check_placeholders(conv.__key__, text, len(images))
        ids, labels, media_parts, media_end, length = [], [], [], 0, 0
        tokens: dict[str, list[torch.Tensor]] = {k: [] for k in self.family.token_keys}
        for start, end, trainable in _pieces(len(text), spans):
            piece = text[start:end]
            n_images = piece.count(self.image_token) if self.image_token else 0
            piece_ids, piece_tokens, piece_media = self._process(piece, images[:n_images], first=(start == 0))
            images = images[n_images:]
            ids.append(piece_ids)
            labels.append(piece_ids.clone() if trainable else torch.full_like(piece_ids, IGNORE_INDEX))
            length += piece_ids.numel()
            for k in tokens:
                tokens[k].append(piece_tokens[k])
            if piece_media:
                media_parts.append(piece_media)
                media_end = length
        if images:
            raise MalformedSample(f"{conv.__key__}: {len(images)} image(s) without a placeholder in the chat template")
        return Encoded(
            key=conv.__key__,
            input_ids=torch.cat(ids),
            labels=torch.cat(labels),
            token_inputs={k: torch.cat(v) for k, v in tokens.items()},
            media=_cat_media(media_parts),
            media_end=media_end,
        )

    # ---- what the model's forward checks -----------------------------------------------------
    def _check_placeholders(self, key: str, text: str, images: int) -> None:
        """The rendered text holds one image placeholder per image (module doc)."""
        found = text.count(self.image_token) if self.image_token else images
        if found != images:
            raise SampleUnfit(
                f"{key}: {found} image placeholder(s) {self.image_token!r} in the rendered text for {images} "
                "image(s): its text spells the placeholder itself",
                kind="media_mismatch",
                remedy=f"remove {self.image_token!r} from the sample's text (each image part adds its own)",
            )

    def _check_media_tokens(self, key: str, ids: torch.Tensor, media: dict[str, torch.Tensor]) -> None:
        """As many image tokens in `ids` as the images' features, by the processor's own expansion."""
        expand, grid = getattr(self.processor, "replace_image_token", None), self._grid_key
        if expand is None or self._image_token_id is None:
            return
        tokens = int((ids == self._image_token_id).sum())
        images = media[grid].shape[0] if grid in media else 0
        features = sum(expand(media, i).count(self.image_token) for i in range(images))
        if tokens != features:
            raise SampleUnfit(
                f"{key}: {tokens} image token(s) for {features} image feature(s) of {images} image(s)",
                kind="media_mismatch",
                remedy=f"remove {self.image_token!r} from the sample's text (each image part adds its own)",
            )

    def _process(self, text: str, images: list[torch.Tensor], *, first: bool):
        """(ids, per-token extras, media) of one piece; the processor only where there are images."""
        if not images:
            ids = self.tokenizer(text, add_special_tokens=first)["input_ids"]
            ids = torch.tensor(ids, dtype=torch.long)
            return ids, {k: torch.zeros_like(ids) for k in self.family.token_keys}, {}
        out = self.processor(text=[text], images=images, return_tensors="pt", add_special_tokens=first)
        ids = out["input_ids"][0].to(torch.long)
        tokens = {k: out[k][0].to(torch.long) for k in self.family.token_keys}
        media = {k: out[k] for k in self.family.media_keys}
        return ids, tokens, media

    # ---- chat template ------------------------------------------------------------------------
    def _render(self, messages: list[dict], *, generation_prompt: bool) -> str:
        return self.processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def _render_with_spans(self, key: str, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
        """The whole text and the character spans of the assistant answers (see module doc)."""
        text = self._render(messages, generation_prompt=False)
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = self._render(messages[:i], generation_prompt=True) if i else ""
            upto = self._render(messages[: i + 1], generation_prompt=False)
            if not (upto.startswith(before) and text.startswith(upto)):
                raise MalformedSample(f"{key}: the chat template does not render turn {i} as a prefix of the next")
            end = len(upto.rstrip())
            if end > len(before):
                spans.append((len(before), end))
        return text, spans

    @staticmethod
    def _images_of(conv: Conversation, messages: list[dict]) -> list[torch.Tensor]:
        return [
            media_pixels(conv, part["media"])
            for message in messages
            for part in message["content"]
            if part["type"] == "image"
        ]

    # ---- collation ----------------------------------------------------------------------------
    def batch_layout(self, samples: list[Encoded]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Shape and dtype of every tensor of the batch `collate` makes of `samples`, by field name
        (`input_ids`, `attention_mask`, `labels`, `token_inputs.<key>`, `media.<key>`; packed: and
        `packed`, data/packing.py)."""
        if self.pack_tokens is not None:
            return packed_layout(samples, self.pack_tokens, self.family)
        shape = (len(samples), max(s.input_ids.numel() for s in samples))
        layout = {name: (shape, torch.long) for name in ("input_ids", "attention_mask", "labels")}
        layout |= {f"token_inputs.{k}": (shape, torch.long) for k in self.family.token_keys}
        return layout | media_layout(samples)

    def collate(self, samples: list[Encoded], out: dict[str, torch.Tensor] | None = None) -> Batch:
        """Right-padded batch, a row per sample, or with `pack_tokens` the samples packed end to end
        into rows of it (data/packing.py); media concatenated in sample order (empty when no sample
        has any).

        `out` may hold preallocated tensors for every field of `batch_layout(samples)` (e.g. views
        into one shared-memory block); they are overwritten and become the batch's tensors.
        """
        if self.pack_tokens is not None:
            return pack(
                samples, row_tokens=self.pack_tokens, pad_token_id=self.pad_token_id, family=self.family, out=out
            )
        if out is None:
            out = {name: torch.empty(shape, dtype=dtype) for name, (shape, dtype) in self.batch_layout(samples).items()}
        input_ids, labels, mask = out["input_ids"], out["labels"], out["attention_mask"]
        tokens = {k: out[f"token_inputs.{k}"] for k in self.family.token_keys}
        input_ids.fill_(self.pad_token_id)
        labels.fill_(IGNORE_INDEX)
        mask.zero_()
        for t in tokens.values():
            t.zero_()
        for row, s in enumerate(samples):
            n = s.input_ids.numel()
            input_ids[row, :n], labels[row, :n], mask[row, :n] = s.input_ids, s.labels, 1
            for k, t in tokens.items():
                t[row, :n] = s.token_inputs[k]
        media = media_into(samples, out)
        return Batch(
            sample_ids=[s.key for s in samples],
            input_ids=input_ids,
            attention_mask=mask,
            labels=labels,
            media=media,
            token_inputs=tokens,
        )

    def collate_prompts(self, prompts: list[EncodedPrompt]) -> PromptBatch:
        """Left-padded prompts (generation appends on the right), answers in the same order."""
        width = max(p.input_ids.numel() for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        tokens = {k: torch.zeros((len(prompts), width), dtype=torch.long) for k in self.family.token_keys}
        for row, p in enumerate(prompts):
            n = p.input_ids.numel()
            input_ids[row, width - n :], mask[row, width - n :] = p.input_ids, 1
            for k in tokens:
                tokens[k][row, width - n :] = p.token_inputs[k]
        return PromptBatch(
            sample_ids=[p.key for p in prompts],
            input_ids=input_ids,
            attention_mask=mask,
            answers=[p.answer for p in prompts],
            media=_cat_media([p.media for p in prompts if p.media]),
            token_inputs=tokens,
            templates=[p.template for p in prompts],
        )


def _pieces(length: int, spans: list[tuple[int, int]]) -> list[tuple[int, int, bool]]:
    """Cut [0, length) at the span borders: (start, end, is_assistant_span), empty pieces dropped."""
    pieces, cursor = [], 0
    for start, end in spans:
        if start > cursor:
            pieces.append((cursor, start, False))
        pieces.append((start, end, True))
        cursor = end
    if length > cursor:
        pieces.append((cursor, length, False))
    return pieces


def _cat_media(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    if not parts:
        return {}
    return {k: torch.cat([p[k] for p in parts]) if len(parts) > 1 else parts[0][k] for k in parts[0]}
