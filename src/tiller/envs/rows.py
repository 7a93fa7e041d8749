"""Rows of a user's data file: JSONL, Parquet, or a Hugging Face `datasets` folder or arrow file.

Every row is read and checked before the run does any work, so a malformed row stops the run at
start with one line naming the file, the row and the column (`row_error`), never minutes in.
Rows are numbered from 1: for JSONL the number is the line number (blank lines are skipped but
still counted), for the other formats the position in the table.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tiller.errors import ConfigError, one_line, require_package

Row = tuple[int, dict[str, Any]]  # (row number, the row's columns)


def row_error(path: str | Path, row: int, column: str, problem: str) -> ConfigError:
    """One line: `file row N, column 'c': problem`."""
    return ConfigError(f"{path} row {row}, column {column!r}: {problem}")


def read_rows(path: str | Path, field: str) -> list[Row]:
    """Every row of the file that config `field` names, as plain Python values.

    `.jsonl`/`.json` (one JSON object per line), `.parquet`, a `datasets` folder written by
    `Dataset.save_to_disk`, or a `datasets` `.arrow` file. An empty file is an error too: a run
    cannot train on nothing."""
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"config field {field}: got {str(p)!r}; no such file or folder")
    if p.suffix in (".jsonl", ".json") and not p.is_dir():
        return _nonempty(_read_jsonl(p), p, field)
    if not p.is_dir() and p.suffix not in (".parquet", ".arrow"):
        raise ConfigError(f"config field {field}: got {str(p)!r}; expected a .jsonl, .parquet "
                          "or .arrow file, or a folder written by datasets' save_to_disk")
    reader = _datasets(field) if p.suffix != ".parquet" else require_package(
        "pyarrow", "data", f"config field {field} (a Parquet file)")
    try:  # the libraries raise many types on a corrupt or foreign file: each is one line
        rows = _read_table(p, reader, field)
    except ConfigError:
        raise
    except Exception as e:
        raise ConfigError(f"config field {field}: got {str(p)!r}; cannot read it: "
                          f"{one_line(e)}") from e
    return _nonempty([(i + 1, r) for i, r in enumerate(rows)], p, field)


def _read_table(p: Path, reader: Any, field: str) -> list[dict[str, Any]]:
    """The rows of a Parquet file, a datasets .arrow file or a save_to_disk folder (one
    split: a saved DatasetDict must be given as its split's folder)."""
    if p.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(p).to_pylist()
    data = reader.Dataset.from_file(str(p)) if p.suffix == ".arrow" else reader.load_from_disk(
        str(p))
    if isinstance(data, reader.DatasetDict):
        raise ConfigError(f"config field {field}: got {str(p)!r}; it holds the splits "
                          f"{sorted(data)}: name one split's folder (e.g. {p / next(iter(data))})")
    return list(data.to_list())


def _datasets(field: str) -> Any:
    return require_package("datasets", "data", f"config field {field} (a datasets file)")


def _read_jsonl(p: Path) -> list[Row]:
    rows: list[Row] = []
    with p.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{p} row {n}: not valid JSON ({e.msg} at char {e.pos})") from e
            if not isinstance(value, dict):
                raise ConfigError(f"{p} row {n}: expected a JSON object with named columns, "
                                  f"got {type(value).__name__}")
            rows.append((n, value))
    return rows


def _nonempty(rows: list[Row], p: Path, field: str) -> list[Row]:
    if not rows:
        raise ConfigError(f"config field {field}: {str(p)!r} holds no rows")
    return rows


def column(path: str | Path, row: Row, name: str, kind: type | tuple[type, ...],
           what: str) -> Any:
    """Column `name` of `row`, which must exist and be a `kind` (described as `what`)."""
    n, values = row
    if name not in values or values[name] is None:
        raise row_error(path, n, name, f"missing; expected {what}")
    value = values[name]
    if not isinstance(value, kind) or isinstance(value, bool) and bool not in _tuple(kind):
        raise row_error(path, n, name, f"expected {what}, got {type(value).__name__} "
                        f"{_short(value)}")
    return value


def messages_column(path: str | Path, row: Row, name: str) -> list[dict[str, Any]]:
    """Column `name` as chat messages: a list of {"role": str, "content": str, ...} objects
    (an assistant message may carry `tool_calls` instead of content)."""
    messages = column(path, row, name, list, "a list of chat messages")
    for i, m in enumerate(messages):
        where = f"message {i}"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise row_error(path, row[0], name, f"{where}: expected an object with a string "
                            f"'role', got {_short(m)}")
        content = m.get("content")
        if not isinstance(content, str) and not (m["role"] == "assistant" and m.get("tool_calls")
                                                 and content is None):
            raise row_error(path, row[0], name, f"{where} ({m['role']}): expected a string "
                            f"'content', got {_short(content)}")
    return [{k: v for k, v in m.items() if v is not None} for m in messages]


def _tuple(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
