"""The single-process GIAANN engine: train, evaluate and generate in one process.

Glue only: column assignment (``ColumnAssigner``) → training increments (``train_batch``) → the
in-memory row store; evaluation and generation drive LIF sessions against the same store. The
distributed daemon replaces the store with storage nodes and keeps everything else.

Training reads the assigner's delimiter flags sentence by sentence (the probabilistic flags are
OR-accumulated and later sentences read them, §3.3), so sentences are *encoded* in order one at a
time and only the increments are batched: ``batch_sentences`` encoded sentences become one
coalesced RowBatch applied to the store, exactly what a compute node would send.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from giaannd.cpus import usable_cpus
from giaannd.model.columns import ColumnAssigner
from giaannd.model.evaluate import EvalResult, Mode, evaluate, generate
from giaannd.model.infer import TEST_SET, TRAIN_SET, LifConstants
from giaannd.model.rowstore import RowStore
from giaannd.model.sentence import EncodedSentence
from giaannd.model.tokens import TaggedSentence, TaggedText
from giaannd.model.train import train_batch

__all__ = ["Engine", "TrainStats", "constants_named"]

#: Sentences whose increments are coalesced into one RowBatch before it is applied (a compute
#: node's send unit). Larger batches coalesce more duplicates; 256 keeps a batch at a few MB.
DEFAULT_BATCH_SENTENCES = 256


def constants_named(name: str) -> LifConstants:
    """``"train"`` → the train-set constants, ``"test"`` → the test-set constants (§4.1)."""
    if name == "train":
        return TRAIN_SET
    if name == "test":
        return TEST_SET
    raise ValueError(f"constant set must be 'train' or 'test', got {name!r}")


@dataclass(slots=True)
class TrainStats:
    sentences_seen: int = 0
    sentences_trained: int = 0
    tokens: int = 0
    batches: int = 0


class Engine:
    """Train / evaluate / generate against one in-memory row store.

    Args:
        assigner: the column assigner (delimiter flags and vocabulary); a fresh one by default.
        store: the row store; by default a fresh one, folding in a thread of its own where the
            process may use more than one CPU (``RowStore(fold_thread=True)``: the same rows, bit
            for bit, with the folds beside the training instead of in it).
        batch_sentences: sentences per coalesced training batch.
        neuron_strengths: also keep the optional neuron strengths (§3.1 step 5).
    """

    def __init__(self, assigner: ColumnAssigner | None = None, store: RowStore | None = None, *,
                 batch_sentences: int = DEFAULT_BATCH_SENTENCES, neuron_strengths: bool = False) -> None:
        if batch_sentences < 1:
            raise ValueError("batch_sentences must be >= 1")
        self.assigner = assigner if assigner is not None else ColumnAssigner()
        self.store = store if store is not None else RowStore(fold_thread=usable_cpus() > 1)
        self.batch_sentences = batch_sentences
        self.neuron_strengths = neuron_strengths
        self.stats = TrainStats()

    # -- training -------------------------------------------------------------------------------
    def train(self, sentences: Iterable[TaggedSentence | TaggedText]) -> TrainStats:
        """Encode (updating flags and vocabulary) and train tagged sentences, in order."""
        pending: list[EncodedSentence] = []
        for tagged in sentences:
            self.stats.sentences_seen += 1
            enc = self.assigner.encode(tagged, update_flags=True)
            if enc is None:
                continue
            pending.append(enc)
            if len(pending) >= self.batch_sentences:
                self._apply(pending)
                pending = []
        if pending:
            self._apply(pending)
        return self.stats

    def train_encoded(self, sentences: Sequence[EncodedSentence]) -> TrainStats:
        """Train already-encoded sentences (no flag or vocabulary updates)."""
        for i in range(0, len(sentences), self.batch_sentences):
            self._apply(sentences[i:i + self.batch_sentences])
        return self.stats

    def _apply(self, encoded: Sequence[EncodedSentence]) -> None:
        out = train_batch(encoded, neuron_strengths=self.neuron_strengths)
        self.store.apply(out.rows, validate=False)  # (train_batch's batches are canonical by construction)
        if out.neurons is not None:
            self.store.apply_neurons(out.neurons)
        self.stats.sentences_trained += out.sentences
        self.stats.tokens += out.tokens
        self.stats.batches += 1

    # -- inference ------------------------------------------------------------------------------
    def encode_prompts(self, prompts: Iterable[TaggedSentence | TaggedText]) -> list[EncodedSentence]:
        """Encode prompts for inference: stored flags are read, never changed."""
        out = []
        for tagged in prompts:
            enc = self.assigner.encode(tagged, update_flags=False)
            if enc is not None:
                out.append(enc)
        return out

    def evaluate(self, prompts: Iterable[TaggedSentence | TaggedText] | Sequence[EncodedSentence],
                 mode: Mode = "teacher",
                 constants: LifConstants = TRAIN_SET, *, keep_details: bool = False) -> EvalResult:
        """Top-1 accuracy (§7) over tagged or already-encoded prompts (``keep_details``: also every
        prediction, per prompt)."""
        encoded: list[EncodedSentence] = []
        tagged: list[TaggedSentence | TaggedText] = []
        for p in prompts:
            if isinstance(p, EncodedSentence):
                encoded.append(p)
            else:
                tagged.append(p)
        if tagged:
            encoded.extend(self.encode_prompts(tagged))
        return evaluate(encoded, self.store, self.assigner, constants, mode, keep_details=keep_details)

    def generate(self, prompt: TaggedSentence | TaggedText | EncodedSentence, max_new_tokens: int = 20,
                 constants: LifConstants = TRAIN_SET) -> list[str]:
        """Free-running continuation of one prompt, as words (stops at the first non-prediction)."""
        if isinstance(prompt, EncodedSentence):
            enc: EncodedSentence | None = prompt
        else:
            # A generation prompt may be shorter than the evaluation minimum (9 tokens, §2.1).
            enc = self.assigner.encode(prompt, update_flags=False, min_tokens=1)
        if enc is None:
            raise ValueError("the prompt was skipped by column assignment (no noun, or empty)")
        nodes = generate(list(zip(enc.column.tolist(), enc.feature.tolist())), self.store, self.assigner,
                         constants, max_new_tokens)
        vocab = self.assigner.vocab
        return [vocab.word_of(c, f) for c, f in nodes]
