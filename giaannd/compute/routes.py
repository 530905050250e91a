"""The compute role's admin operations: request checking and error mapping around ComputeService.

Theory of operation
-------------------
Each handler parses and bounds its JSON body, calls one ``ComputeService`` method and maps the
outcome to HTTP. The operations (routes, giaannctl verbs) are declared in giaannd/operations.py;
by id, what each accepts and answers:

==================  ==============================================================================
``train.start``     ``{"corpus": path, "workers"?, "coalesce"?, "epochs"?, "limit"?, "cluster"?}`` →
                    ``{"job_id"}``; CoNLL-U is read as is, other files are tagged (cached);
                    ``cluster`` (default ``compute.cluster-jobs``): a cluster job (one epoch)
``train.list``      every job document: this node's, then the cluster's (job index, ended here)
``train.status``    ``{"state", "done", "total", "unit", "resumed_from", ...}`` (jobs.py); a
                    cluster job's from the registers, on any node, with ``by_node``
``train.cancel``    cancel a job of this node, or a cluster job → its document
``train.resume``    resume a failed journaled job, or follow a running cluster job here →
                    ``{"job_id"}``
``eval``            ``{"corpus"? | "prompts"? | "prompt_lines"?, "limit"?, "constants": "train"|"test",
                    "mode"?}`` → top-1; ``prompts``: a file, one prompt per non-blank line, tagged
                    whole (cached); ``prompt_lines``: the prompts inline, a list of one-line strings
``evals.list``      ``{"evals": [{"at", "top1", "matches", "prediction_tokens", "prompts",
                    "constants", "mode", "trained", "source"}, ...]}``: the successful evals,
                    oldest first (state.py ``EvalHistory``, ``compute.eval-history``)
``generate``        ``{"prompt": text | [[form, lemma, upos, xpos], ...], "max_tokens"}``
``export``          ``{"path", "overwrite"?}`` → JSONL export of every row of the cluster (storage
                    scan)
``column.rows``     ``GET /v1/columns/{column}/rows?limit=N`` (column: id or concept word) →
                    ``{"column", "word", "total_entries", "truncated", "features": {...},
                    "entries": {...}}`` (cluster_export.py ``column_contents``); 404 ``not_found``
                    when no owner holds a row of it
==================  ==============================================================================

Paths: a corpus or prompt file must resolve inside the service's ``corpus_dir``, an export inside
its ``export_dir`` (relative paths are taken inside them; paths.py); an export replaces an
existing file only if it is a previous export or ``overwrite`` is true.

Error mapping: a path outside its allowed directory is a 403; other bad input (missing or
unreadable corpus, a path that cannot be resolved, bad JSON, a field the operation does not take, a
field of the wrong type, out-of-range numbers, a query parameter given twice, an export path that
is a directory or cannot be written, malformed tokens, a prompt too long to tag) is a 400 that
changed nothing; an unknown job or journal (or an id longer than any job's, not asked of storage)
is a 404; a running job to resume, a corrupt journal, an export over a file that is not a previous
export, or an export with ids no vocabulary holds is a 409; storage failing or absent
(``STORAGE_ERRORS``, or no storage client yet) and a missing tagger are 503. Prompt text is tagged
here with spaCy (loaded on first use, in a thread).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import msgspec
from aiohttp import web

from giaannd.client.storage_client import StorageRequestError
from giaannd.compute.cluster_export import ExportWriteError, VocabularyMissing
from giaannd.compute.durable_jobs import TAG_CACHE_DIR
from giaannd.compute.paths import NotAnExport, PathOutside, check_export_target, resolve_inside
from giaannd.compute.train import load_corpus, load_prompts
from giaannd.errors import AdminHTTPError, InputError
from giaannd.json_body import json_object
from giaannd.model.ids import parse_column
from giaannd.model.subwords import ProfileMismatchError
from giaannd.model.tokens import (
    TaggedSentence,
    TaggerUnavailableError,
    Token,
    load_bundled_corpus,
    load_english,
    tag_lines,
)
from giaannd.operations import Binder, Handler
from peers.errors import PeersError

if TYPE_CHECKING:
    from giaannd.compute.service import ComputeService

__all__ = [
    "DEFAULT_EVAL_LIMIT",
    "MAX_EPOCHS",
    "MAX_EVAL_PROMPTS",
    "MAX_GENERATE_TOKENS",
    "STORAGE_ERRORS",
    "ComputeRoutes",
]

#: Prompts evaluated when ``/v1/eval`` names no limit and no prompt file (a prompt file is
#: evaluated whole, up to MAX_EVAL_PROMPTS: the benchmark files have ~1,000 lines).
DEFAULT_EVAL_LIMIT: Final = 200
#: Upper bounds on request sizes (admin requests are small; corpora travel by path).
MAX_EVAL_PROMPTS: Final = 100_000
#: Longest inline prompt (``prompt_lines``): a prompt is a sentence or a few, not a document.
MAX_PROMPT_CHARS: Final = 10_000
MAX_GENERATE_TOKENS: Final = 1024
MAX_EPOCHS: Final = 1000
#: Longest job id looked up: ids are 16 hex digits (``secrets.token_hex(8)``); a longer one names no
#: job, and the register keys made from it would be over ``protocol.MAX_REGISTER_KEY_CHARS``.
MAX_JOB_ID_CHARS: Final = 64
#: The constants an eval or a generation runs with; the first is the default.
_CONSTANTS: Final = ("train", "test")
#: How long ``train cancel`` of a job of this node waits for its task to end before answering.
CANCEL_WAIT_S: Final = 10.0
#: Failures of using storage at all: answered 503 (LookupError: no storage members known).
STORAGE_ERRORS: Final = (StorageRequestError, PeersError, OSError, LookupError)


class ComputeRoutes:
    """The admin operations of ``service`` (module docstring)."""

    def __init__(self, service: ComputeService) -> None:
        self.service = service
        self._nlp: Any = None  # the spaCy pipeline for prompt text, loaded on first use

    def register(self, admin: Binder) -> None:
        """Bind every compute operation to its handler."""
        handlers: dict[str, Handler] = {
            "train.start": self._post_train, "train.list": self._get_jobs, "train.status": self._get_job,
            "train.resume": self._post_resume, "train.cancel": self._post_cancel, "eval": self._post_eval,
            "evals.list": self._get_evals, "generate": self._post_generate,
            "export": self._post_export, "column.rows": self._get_column_rows}
        for op_id, handler in handlers.items():
            admin.bind(op_id, handler)

    async def _post_train(self, request: web.Request, params: Mapping[str, str]) -> Any:
        body = await json_object(request, ("corpus", "workers", "coalesce", "epochs", "limit", "cluster"))
        corpus = self._corpus_path(body.get("corpus"), required=True)
        workers = _opt_int(body, "workers", 1, 1024)
        coalesce = _opt_int(body, "coalesce", 1, 1 << 20)
        epochs = _opt_int(body, "epochs", 1, MAX_EPOCHS) or 1
        limit = _opt_int(body, "limit", 1, 1 << 31)
        # the default, unless the request says: a cluster job with compute.cluster-jobs, except
        # for more than one epoch (cluster jobs train one; compute.cluster-jobs's description)
        cluster = body.get("cluster", self.service.settings.cluster_jobs and epochs == 1)
        if not isinstance(cluster, bool):
            raise AdminHTTPError(400, "cluster must be true or false", "bad_request")
        assert corpus is not None  # required=True
        if cluster:
            if epochs != 1:
                raise AdminHTTPError(400, "a cluster job trains one epoch", "bad_request")
            try:
                return {"job_id": self.service.submit_cluster(corpus, coalesce=coalesce, limit=limit)}
            except OSError as exc:
                raise AdminHTTPError(400, f"corpus {corpus}: {exc}", "bad_request") from None
            except ProfileMismatchError as exc:
                raise AdminHTTPError(400, str(exc), exc.reason) from None
        try:
            job = await self.service.submit_corpus(corpus, workers=workers, coalesce=coalesce, epochs=epochs,
                                                   limit=limit)
        except OSError as exc:
            raise AdminHTTPError(400, f"corpus {corpus}: {exc}", "bad_request") from None
        return {"job_id": job.job_id}

    async def _get_jobs(self, request: web.Request, params: Mapping[str, str]) -> Any:
        jobs = [j.as_dict() for j in self.service.jobs.all()]
        cluster = self.service.cluster
        if cluster is not None and self.service.storage is not None:
            try:
                for job_id in await cluster.list_ids():
                    doc = await cluster.document(job_id)
                    if doc is not None:
                        jobs.append(doc)
            except STORAGE_ERRORS as exc:
                raise AdminHTTPError(503, f"storage: {exc}", "unavailable") from None
        return {"jobs": jobs}

    async def _get_job(self, request: web.Request, params: Mapping[str, str]) -> Any:
        job = self.service.jobs.get(params["job_id"])
        if job is not None:
            return job.as_dict()
        return await self._cluster_doc(params["job_id"])

    async def _cluster_doc(self, job_id: str) -> dict[str, Any]:
        """A cluster job's document from the registers (404: none; 503: storage failing)."""
        cluster = self.service.cluster
        if cluster is None:
            raise AdminHTTPError(404, f"no job {job_id!r} on this node", "not_found")
        if len(job_id) > MAX_JOB_ID_CHARS:  # not asked of storage: its register keys would be refused (503)
            raise AdminHTTPError(404, f"no job {job_id[:MAX_JOB_ID_CHARS]!r}...: job ids are at most "
                                      f"{MAX_JOB_ID_CHARS} characters", "not_found")
        try:
            self.service.storage_client()  # 503 while there is no storage client
            doc = await cluster.document(job_id)
        except STORAGE_ERRORS as exc:
            raise AdminHTTPError(503, f"storage: {exc}", "unavailable") from None
        if doc is None:
            raise AdminHTTPError(404, f"no job {job_id!r} on this node or in the cluster", "not_found")
        return doc

    async def _post_cancel(self, request: web.Request, params: Mapping[str, str]) -> Any:
        job = self.service.jobs.get(params["job_id"])
        if job is not None:
            if job.task is not None and job.state == "running":
                job.cancel()
                await asyncio.wait({job.task}, timeout=CANCEL_WAIT_S)
            return job.as_dict()
        doc = await self._cluster_doc(params["job_id"])  # 404 / 503
        assert self.service.cluster is not None
        try:
            await self.service.cluster.cancel(params["job_id"])
        except STORAGE_ERRORS as exc:
            raise AdminHTTPError(503, f"storage: {exc}", "unavailable") from None
        return doc

    async def _post_resume(self, request: web.Request, params: Mapping[str, str]) -> Any:
        try:
            job = await self.service.resume(params["job_id"])
        except KeyError:
            return await self._follow_cluster(params["job_id"])
        except ValueError as exc:
            raise AdminHTTPError(409, str(exc), "conflict") from None
        return {"job_id": job.job_id}

    async def _follow_cluster(self, job_id: str) -> dict[str, Any]:
        """``train resume`` of a cluster job: this node follows it (it goes on by itself elsewhere)."""
        doc = await self._cluster_doc(job_id)
        if doc["state"] != "running" or doc.get("phase") == "uploading":
            raise AdminHTTPError(409, f"cluster job {job_id!r} is {doc['state']}: nothing to resume", "conflict")
        assert self.service.cluster is not None
        self.service.cluster.follow(job_id)
        return {"job_id": job_id}

    async def _post_eval(self, request: web.Request, params: Mapping[str, str]) -> Any:
        body = await json_object(request, ("corpus", "prompts", "prompt_lines", "limit", "constants", "mode", "spread"))
        limit = _opt_int(body, "limit", 1, MAX_EVAL_PROMPTS)
        constants, mode = _choice(body, "constants", _CONSTANTS), _choice(body, "mode", ("teacher", "free"))
        spread = body.get("spread")
        if spread is not None and not isinstance(spread, bool):
            raise AdminHTTPError(400, "spread must be true or false", "bad_request")
        path = self._corpus_path(body.get("corpus"), required=False)
        prompt_file = self._corpus_path(body.get("prompts"), required=False, what="prompts")
        lines = _prompt_lines(body.get("prompt_lines"))
        if sum(x is not None for x in (path, prompt_file, lines)) > 1:
            raise AdminHTTPError(400, "give one of corpus, prompts and prompt_lines", "bad_request")
        cache_dir = self.service.data_dir / TAG_CACHE_DIR
        try:
            if lines is not None:  # each tagged whole, as a prompt file's lines are
                prompts = await asyncio.to_thread(self._tag_each, lines[:limit or MAX_EVAL_PROMPTS])
            elif prompt_file is not None:
                prompts = await asyncio.to_thread(load_prompts, prompt_file, cache_dir, limit or MAX_EVAL_PROMPTS)
            else:
                n = limit or DEFAULT_EVAL_LIMIT
                prompts = await asyncio.to_thread(
                    (lambda: load_corpus(path, cache_dir, n)) if path is not None else (lambda: load_bundled_corpus(n)))
        except (ValueError, OSError) as exc:  # CorpusFormatError is a ValueError
            raise AdminHTTPError(400, str(exc), "bad_request") from None
        except TaggerUnavailableError as exc:
            raise AdminHTTPError(503, str(exc), "unavailable") from None
        named = prompt_file or path
        source = (named.name if named is not None else "inline prompts" if lines is not None
                  else f"bundled corpus, first {limit or DEFAULT_EVAL_LIMIT}")
        try:
            return await self.service.evaluate(prompts, constants, mode, spread=spread, source=source)
        except STORAGE_ERRORS as exc:
            raise AdminHTTPError(503, f"storage: {exc}", "unavailable") from None

    async def _get_evals(self, request: web.Request, params: Mapping[str, str]) -> Any:
        return self.service.evals.as_dict()

    async def _post_generate(self, request: web.Request, params: Mapping[str, str]) -> Any:
        body = await json_object(request, ("prompt", "max_tokens", "constants"))
        max_tokens = _opt_int(body, "max_tokens", 0, MAX_GENERATE_TOKENS)
        constants = _choice(body, "constants", _CONSTANTS)
        prompt = await self._tagged_prompt(body.get("prompt"))
        try:
            return await self.service.generate(prompt, 20 if max_tokens is None else max_tokens, constants)
        except STORAGE_ERRORS as exc:
            raise AdminHTTPError(503, f"storage: {exc}", "unavailable") from None

    async def _tagged_prompt(self, prompt: Any) -> TaggedSentence:
        if isinstance(prompt, list) and prompt and all(isinstance(t, (list, tuple)) for t in prompt):
            if not all(len(t) == 4 and all(isinstance(x, str) and x for x in t) for t in prompt):
                raise AdminHTTPError(400, "prompt tokens must be [form, lemma, upos, xpos] strings", "bad_request")
            return tuple(Token(*t) for t in prompt)
        if isinstance(prompt, list) and prompt and all(isinstance(t, str) for t in prompt):
            prompt = " ".join(prompt)
        if not isinstance(prompt, str) or not prompt.strip():
            raise AdminHTTPError(400, "prompt must be non-empty text or a list of tokens", "bad_request")
        return await asyncio.to_thread(self._tag, prompt)

    def _tag(self, text: str) -> TaggedSentence:
        # A prompt is one sequence, tagged whole, as the reference tags a prompt line.
        try:
            nlp = self._english()
        except TaggerUnavailableError as exc:
            raise AdminHTTPError(503, str(exc), "unavailable") from None
        try:
            return tuple(t for s in tag_lines([text.replace("\n", " ")], nlp=nlp) for t in s)
        except ValueError as exc:  # spaCy refuses a text over its max_length (1,000,000 characters)
            raise AdminHTTPError(400, f"prompt cannot be tagged: {exc}", "bad_request") from None

    def _tag_each(self, lines: list[str]) -> list[TaggedSentence]:
        """Inline prompts, each tagged whole (TaggerUnavailableError: the caller's 503)."""
        return list(tag_lines(lines, nlp=self._english()))

    def _english(self) -> Any:
        """The spaCy pipeline for prompt text, loaded on first use (TaggerUnavailableError)."""
        if self._nlp is None:
            self._nlp = load_english()
        return self._nlp

    def _corpus_path(self, value: Any, *, required: bool, what: str = "corpus") -> Path | None:
        """A file the request names for reading (a corpus, a prompt file): inside
        ``compute.corpus-dir`` (403 otherwise), and an existing file (400 otherwise)."""
        if value is None and not required:
            return None
        if not isinstance(value, str) or not value:
            raise AdminHTTPError(400, f"{what} must be a file path", "bad_request")
        path = _inside(value, self.service.corpus_dir, what, "compute.corpus-dir")
        try:
            found = path.is_file()
        except OSError as exc:  # a name too long: is_file raises what it cannot stat for that
            raise AdminHTTPError(400, f"{what} {path}: {exc.strerror}", "bad_request") from None
        if not found:
            raise AdminHTTPError(400, f"{what} {path} does not exist or is not a file", "bad_request")
        return path

    async def _post_export(self, request: web.Request, params: Mapping[str, str]) -> Any:
        body = await json_object(request, ("path", "overwrite"))
        value, overwrite = body.get("path"), body.get("overwrite", False)
        if not isinstance(value, str) or not value:
            raise AdminHTTPError(400, "path must be a file path", "bad_request")
        if not isinstance(overwrite, bool):
            raise AdminHTTPError(400, "overwrite must be true or false", "bad_request")
        path = _inside(value, self.service.export_dir, "export path", "compute.export-dir")
        try:
            await asyncio.to_thread(check_export_target, path, overwrite=overwrite)
        except NotAnExport as exc:
            raise AdminHTTPError(409, str(exc), "not_an_export") from None
        except (InputError, OSError) as exc:
            raise AdminHTTPError(400, str(exc), "bad_request") from None
        try:
            return await self.service.export(path)
        except ExportWriteError as exc:
            raise AdminHTTPError(400, str(exc), "bad_request") from None
        except VocabularyMissing as exc:
            raise AdminHTTPError(409, f"{exc} (rows trained without a replicated vocabulary)",
                                 "conflict") from None
        except STORAGE_ERRORS as exc:
            raise AdminHTTPError(503, f"storage: {exc}", "unavailable") from None


    async def _get_column_rows(self, request: web.Request, params: Mapping[str, str]) -> Any:
        try:
            column, _ = parse_column(params["column"])
        except ValueError as exc:
            raise AdminHTTPError(400, str(exc), "bad_request") from None
        settings = self.service.settings
        most = settings.column_rows_max_entries
        limit = _query_int(request, "limit", 1, most) or min(settings.column_rows_default_entries, most)
        try:
            doc = await self.service.column_rows(column, limit)
        except STORAGE_ERRORS as exc:
            raise AdminHTTPError(503, f"storage: {exc}", "unavailable") from None
        if doc is None:
            raise AdminHTTPError(404, f"column {params['column']} has no rows", "not_found")
        # encoded here, in a thread: ~110 ms per million entries would otherwise stall the loop
        body = await asyncio.to_thread(msgspec.json.encode, doc)
        return web.Response(body=body, content_type="application/json")


def _query_int(request: web.Request, key: str, lo: int, hi: int) -> int | None:
    """An integer query parameter in [lo, hi] (None when absent), else a 400."""
    given = request.query.getall(key, [])
    if len(given) > 1:  # which one was meant? (aiohttp's .get would take the first, silently)
        raise AdminHTTPError(400, f"{key} is given {len(given)} times; give it once", "bad_request")
    if not given:
        return None
    raw = given[0]
    try:
        value = int(raw)
    except ValueError:
        value = lo - 1
    if not lo <= value <= hi:
        raise AdminHTTPError(400, f"{key} must be an integer in [{lo}, {hi}]", "bad_request")
    return value


def _prompt_lines(value: Any) -> list[str] | None:
    """``prompt_lines`` of an eval request: prompts given inline (the Python client's list), each a
    non-blank single line (a newline would make it two prompts where a file has them)."""
    if value is None:
        return None
    if (not isinstance(value, list) or not value or len(value) > MAX_EVAL_PROMPTS
            or not all(isinstance(x, str) and x.strip() and "\n" not in x and len(x) <= MAX_PROMPT_CHARS
                       for x in value)):
        raise AdminHTTPError(400, f"prompt_lines must be 1 to {MAX_EVAL_PROMPTS} non-blank one-line strings "
                                  f"of at most {MAX_PROMPT_CHARS} characters", "bad_request")
    return value


def _choice(body: Mapping[str, Any], key: str, choices: tuple[str, ...]) -> str:
    """A field that is one of ``choices`` (absent or null: the first), else a 400: ``0``, ``[]``
    or ``""`` are not taken for the default."""
    value = body.get(key)
    if value is None:
        return choices[0]
    if not isinstance(value, str) or value not in choices:
        raise AdminHTTPError(400, f"{key} must be one of {', '.join(map(repr, choices))}", "bad_request")
    return value


def _opt_int(body: Mapping[str, Any], key: str, lo: int, hi: int) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise AdminHTTPError(400, f"{key} must be an integer in [{lo}, {hi}]", "bad_request")
    return value


def _inside(value: str, root: Path, what: str, knob: str) -> Path:
    try:
        return resolve_inside(value, root, what=what, knob=knob)
    except PathOutside as exc:
        raise AdminHTTPError(403, str(exc), "forbidden") from None
    except (ValueError, OSError) as exc:  # a NUL byte in it; a name too long to resolve
        raise AdminHTTPError(400, f"{what} {value!r} is not a usable path: {exc}", "bad_request") from None
