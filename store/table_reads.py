"""A run's table reads: whole tables, some columns, batches of a large part, row counts, each
part from memory when the store holds it (`RunStore(hold=True)`) and else from its file,
validated against `store.schema`.

`TableReads` is a part of `RunStore` (store/run_store.py), which provides what these
reads stand on: `root` and `storage` (where the files are), `files` (the live files of a table
and rounds, as the run's log lists them), `held_part`, `where` (a file for messages) and
`state` (the log's records of the files).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from store import schema
from store.errors import first_line
from store.layout import contract_columns, part_name, round_of


class TableReads:
    """The read methods of `RunStore` (see the module docstring)."""

    def source(self, rel: str) -> str | pa.BufferReader:
        """What pyarrow reads the file `rel` from: its local path, or its bytes from the object store."""
        if self.root is not None:
            return str(self.root / rel)
        return pa.BufferReader(self.storage.read(rel))

    def read_part(self, rel: str, table: str, columns: Sequence[str] | None = None) -> pa.Table:
        """One live part file (held: from memory), validated as `table`; `columns`: only those."""
        held = self.held_part(rel)
        if held is not None:
            return held.table if columns is None else contract_columns(table, held.table, columns)
        data = self._read_file(rel, table)
        return data if columns is None else contract_columns(table, data, columns)

    def _read_file(self, rel: str, table: str) -> pa.Table:
        where = self.where(rel)
        try:
            data = pq.read_table(self.source(rel))
        except FileNotFoundError:
            raise schema.SchemaError(f"{table} table ({where}): file not found (listed by the run's log)") from None
        except (pa.ArrowInvalid, OSError) as exc:
            raise schema.SchemaError(f"{table} table ({where}): not a readable Parquet file "
                                     f"({first_line(exc)})") from None
        return schema.validate(data, table, where)

    def read(self, table: str, rounds: int | Sequence[int] | None = None, validate: bool = True,
             columns: Sequence[str] | None = None) -> pa.Table:
        """All rounds (or the given ones) of `table`, as a pyarrow Table.

        Validated against `store.schema` unless `validate=False`; an empty table with the
        schema when nothing was written yet. The `round` column is checked against each file's
        `round=<n>` folder. `columns`: only these contract columns, in this order (`read_columns`).
        """
        if columns is not None:
            return self.read_columns(table, columns, rounds, validate)
        files = self.files(table, rounds)
        if not files:
            return schema.empty(table)
        parts = []
        for rel in files:
            held = self.held_part(rel)
            part = held.table if held is not None else self._read_file(rel, table) if validate else \
                pq.read_table(self.source(rel))
            if validate and table != "prompts":
                self._check_round(table, rel, part)
            parts.append(part)
        result = pa.concat_tables(parts, promote_options="permissive")
        return schema.validate(result, table, self.where(table)) if validate else result

    def _check_round(self, table: str, rel: str, part: pa.Table) -> None:
        folder = round_of(rel)
        if not part.num_rows or folder is None:
            return
        lo, hi = pc.min_max(part.column("round")).as_py().values()
        if (lo, hi) != (folder, folder):
            raise schema.SchemaError(f"{table} table ({self.where(rel)}): column 'round' holds {lo}..{hi}, "
                                     f"but the file is in folder round={folder}")

    def read_columns(self, table: str, columns: Sequence[str], rounds: int | Sequence[int] | None = None,
                     validate: bool = True, exclude_parts: Sequence[str] = ()) -> pa.Table:
        """`columns` of `table` (contract columns, e.g. the keys and reward of scores, and the
        samples table's optional trajectory columns, null in parts without them), the same
        rows and values as `read(...).select(columns)` without reading the other columns.
        `exclude_parts`: part names (`part-<name>-<sha>.parquet`) left unread, e.g. a stage's own output."""
        parts = list(self.iter_columns(table, columns, rounds, validate, exclude_parts))
        if parts:  # (permissive: an optional column is nullable where a part lacks it)
            return pa.concat_tables(parts, promote_options="permissive")
        return pa.schema(_fields(table, columns)).empty_table()

    def iter_columns(self, table: str, columns: Sequence[str], rounds: int | Sequence[int] | None = None,
                     validate: bool = True, exclude_parts: Sequence[str] = (),
                     batch_rows: int | None = None) -> Iterator[pa.Table]:
        """read_columns as an iterator: one table per file, or per batch of <= `batch_rows` rows
        of a file (memory then holds one batch: a curation stage's pass over a large round),
        each checked as read_columns checks the whole. A part `held` is taken from memory, whole."""
        wanted = pa.schema(_fields(table, columns))
        check_round = validate and table != "prompts"
        for rel in self.files(table, rounds):
            if part_name(rel) in exclude_parts:
                continue
            held = self.held_part(rel)
            if held is not None:  # validated when it was committed
                yield contract_columns(table, held.table, columns)
                continue
            where = self.where(rel)
            try:
                file = pq.ParquetFile(self.source(rel))
                found = file.schema_arrow
                if validate:
                    schema.validate(found.empty_table(), table, where)
                present = [c for c in columns if c in found.names]
                extra = ["round"] if check_round and "round" not in present else []
                if batch_rows is None:
                    pieces: Iterator[pa.Table] = iter([file.read(columns=present + extra)])
                else:
                    batches = file.iter_batches(batch_size=batch_rows, columns=present + extra)
                    pieces = (pa.Table.from_batches([batch]) for batch in batches)
                for part in pieces:
                    if check_round:
                        self._check_round(table, rel, part)
                    part = contract_columns(table, part, columns)
                    if validate:
                        for field in wanted:
                            nulls = part.column(field.name).null_count
                            if not field.nullable and nulls:
                                raise schema.SchemaError(f"{table} table ({where}): column "
                                                         f"{field.name!r} has {nulls} null value(s)")
                    yield part
            except FileNotFoundError:
                raise schema.SchemaError(f"{table} table ({where}): file not found (listed by the run's log)"
                                         ) from None
            except (pa.ArrowInvalid, OSError) as exc:
                raise schema.SchemaError(f"{table} table ({where}): not a readable Parquet file "
                                         f"({first_line(exc)})") from None

    def row_count(self, rel: str) -> int:
        """Rows of a live part file (from memory or its commit's record)."""
        held = self.held_part(rel)
        return held.table.num_rows if held is not None else self.state.files[rel].rows


def _fields(table: str, columns: Sequence[str]) -> list[pa.Field]:
    """The fields of `columns` of `table`: its contract's, or an optional column's
    (schema.field_of: a samples trajectory column) as nullable; a ValueError for any other."""
    contract = schema.SCHEMAS[table]
    fields = []
    for column in columns:
        try:
            field = schema.field_of(table, column)
        except KeyError:
            raise ValueError(f"the {table} table has no column {column!r} in its contract; "
                             f"known: {', '.join(contract.names)}") from None
        fields.append(field if column in contract.names else field.with_nullable(True))
    return fields
