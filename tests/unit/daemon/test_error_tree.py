"""The exception tree (giaannd/errors.py): every exception giaannd defines roots in GiaannError, says
whose fault it is, carries a reason token, and maps to the right exit status at the CLI boundary."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re

import pytest

import giaannd
from giaannd import cli
from giaannd.client.errors import REQUEST_FAILURES, StorageRequestError
from giaannd.errors import (
    EXIT_FAILURE,
    EXIT_USAGE,
    AdminHTTPError,
    ConfigError,
    CorruptDataError,
    CorruptFileError,
    GiaannError,
    HostEnvironmentError,
    InputError,
    Refused,
    RemoteFault,
)
from giaannd.model.tokens import CorpusFormatError, TaggerUnavailableError
from giaannd.protocol import ProtocolViolation
from peers.errors import PeersError

#: A reason is a metrics label value and an API ``code``: short, lower-case, no spaces.
REASON = re.compile(r"[a-z][a-z0-9_]{0,39}")

#: The fault classes: whose fault it is decides the exit status.
#: (Corrupt data is exit 2 as well, issue 16 item 8: a restart cannot fix the file, so systemd's
#: RestartPreventExitStatus=2 must stop the restart loop.)
FAULTS = {InputError: EXIT_USAGE, HostEnvironmentError: EXIT_USAGE, CorruptDataError: EXIT_USAGE,
          RemoteFault: EXIT_FAILURE, Refused: EXIT_FAILURE}


def _giaannd_exceptions() -> list[type[BaseException]]:
    found: set[type[BaseException]] = set()
    for info in pkgutil.walk_packages(giaannd.__path__, "giaannd."):
        if info.name.rpartition(".")[2] == "__main__":
            continue
        module = importlib.import_module(info.name)
        for obj in vars(module).values():
            if inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == info.name:
                found.add(obj)
    return sorted(found, key=lambda c: f"{c.__module__}.{c.__qualname__}")


EXCEPTIONS = _giaannd_exceptions()


def test_error_tree_finds_the_exceptions_of_every_layer() -> None:
    names = {c.__name__ for c in EXCEPTIONS}
    # one from each layer, so an import walk that silently found nothing cannot pass
    assert {"GiaannError", "ProtocolViolation", "RemoteStoreFull", "CorpusFormatError", "StoreFullError",
            "TopologyOpError", "ClientError", "JournalCorrupt"} <= names


@pytest.mark.parametrize("cls", EXCEPTIONS, ids=lambda c: f"{c.__module__}.{c.__qualname__}")
def test_error_tree_every_exception_roots_in_giaannd_error_with_a_reason(cls: type[BaseException]) -> None:
    assert issubclass(cls, GiaannError | PeersError), f"{cls} roots in neither GiaannError nor PeersError"
    reason = getattr(cls, "reason", None)
    assert isinstance(reason, str) and REASON.fullmatch(reason), f"{cls}: reason {reason!r}"


@pytest.mark.parametrize("cls", EXCEPTIONS, ids=lambda c: f"{c.__module__}.{c.__qualname__}")
def test_error_tree_each_error_has_at_most_one_fault(cls: type[BaseException]) -> None:
    faults = [f for f in FAULTS if issubclass(cls, f)]
    assert len(faults) <= 1, f"{cls} is {faults}"
    if faults:
        assert getattr(cls, "exit_code", None) == FAULTS[faults[0]], cls


def test_error_tree_reason_is_a_class_default_overridable_per_instance() -> None:
    assert GiaannError("x").reason == "error"
    assert GiaannError("x", reason="disk_full").reason == "disk_full"
    assert GiaannError.reason == "error" and str(GiaannError("x", reason="disk_full")) == "x"
    assert ConfigError("bad", "$.a.b").reason == "config"
    assert HostEnvironmentError("port in use", reason="port_in_use").reason == "port_in_use"


def test_error_tree_admin_http_error_code_is_its_reason() -> None:
    exc = AdminHTTPError(409, "busy", "conflict")
    assert exc.code == exc.reason == "conflict" and exc.status == 409 and exc.message == "busy"
    assert AdminHTTPError(500, "boom").code == "error"


#: Errors that stay a ``ValueError`` next to their fault: ``except ValueError`` sites catch them
#: (compute/routes.py answers 400 for a bad corpus; streams, repair and the stores refuse bad input).
STILL_VALUE_ERRORS = {"ProtocolViolation", "CorpusFormatError", "LexiconFormatError", "SnapshotError",
                      "StateFileError", "VocabLogCorrupt", "VocabCollision", "IdCollisionError",
                      "VocabularyMissing"}


def test_error_tree_keeps_the_builtin_bases_callers_catch() -> None:
    by_name = {c.__name__: c for c in EXCEPTIONS}
    assert {n for n, c in by_name.items() if issubclass(c, ValueError)} == STILL_VALUE_ERRORS
    assert issubclass(ProtocolViolation, RemoteFault) and issubclass(CorpusFormatError, InputError)
    # a replicated operation books a typed refusal as "this node failed" (client/errors.py)
    assert issubclass(StorageRequestError, RemoteFault) and StorageRequestError in REQUEST_FAILURES


@pytest.mark.parametrize(("exc", "status"), [
    (ConfigError("expected int", "$.storage.capacity-bytes"), EXIT_USAGE),
    (InputError("corpus.txt: empty"), EXIT_USAGE),
    (HostEnvironmentError("cannot listen on 127.0.0.1:1: address in use"), EXIT_USAGE),
    (TaggerUnavailableError("spaCy is not installed"), EXIT_USAGE),
    (CorruptFileError("/var/lib/giaannd/node-id", "not a UUID"), EXIT_USAGE),
    (RemoteFault("no seed answered"), EXIT_FAILURE),
    (Refused("another operation is running"), EXIT_FAILURE),
    (GiaannError("failed"), EXIT_FAILURE),
])
def test_error_tree_cli_maps_faults_to_exit_status(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                                                    exc: GiaannError, status: int) -> None:
    def run(*_: object) -> int:
        raise exc
    monkeypatch.setattr(cli, "_run", run)
    assert cli.main([]) == status
    assert capsys.readouterr().err == f"giaannd: error: {exc}\n"
