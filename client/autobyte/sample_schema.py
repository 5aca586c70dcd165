"""A stored step sample's columns, derived from StepMetrics' dataclass fields (autobyte/types.py).

The daemon's table of samples (autobyted/storage/models.py), its row packing and its read-back
(autobyted/storage/sql.py) all come from here, so that a new field of StepMetrics is declared once.
The configuration a step ran with is stored flat, as Config's own fields. Plain Python only: the
client imports this module too and never needs sqlalchemy.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from collections.abc import Sequence
from typing import NamedTuple

from autobyte.types import Config, StepMetrics


class SampleColumn(NamedTuple):
    """One stored column of a sample: its name (the field's), kind ("int64", "int32", "float"),
    whether it may be NULL (a Config field: none / unlimited), and a server default or None."""

    name: str
    kind: str
    nullable: bool
    server_default: str | None


_CONFIG_FIELDS = tuple(f.name for f in dataclasses.fields(Config))


def _columns() -> tuple[SampleColumn, ...]:
    columns = []
    for field in dataclasses.fields(StepMetrics):
        if field.name == "config":
            columns += [
                SampleColumn(f.name, f.metadata["column"], True, None)
                for f in dataclasses.fields(Config)
            ]
        else:
            columns.append(
                SampleColumn(
                    field.name,
                    field.metadata["column"],
                    False,
                    field.metadata.get("server_default"),
                )
            )
    return tuple(columns)


# In StepMetrics' field order, the configuration's fields where `config` stands.
SAMPLE_COLUMNS: tuple[SampleColumn, ...] = _columns()
SAMPLE_COLUMN_NAMES: tuple[str, ...] = tuple(column.name for column in SAMPLE_COLUMNS)

# attrgetter reads dotted names in C: the daemon packs tens of thousands of samples a second.
_row_of = operator.attrgetter(
    *(
        f"config.{column.name}" if column.name in _CONFIG_FIELDS else column.name
        for column in SAMPLE_COLUMNS
    )
)


def sample_row(metrics: StepMetrics) -> tuple:
    """The sample's values in SAMPLE_COLUMNS order."""
    return _row_of(metrics)


@functools.lru_cache(maxsize=1024)
def _config(*values: int | None) -> Config:
    """Config is frozen: the few configurations a job runs are built once."""
    return Config(*values)


_CONFIG_SLICE = slice(
    SAMPLE_COLUMN_NAMES.index(_CONFIG_FIELDS[0]), SAMPLE_COLUMN_NAMES.index(_CONFIG_FIELDS[-1]) + 1
)
_METRIC_NAMES = tuple(name for name in SAMPLE_COLUMN_NAMES if name not in _CONFIG_FIELDS)
_METRIC_POSITIONS = tuple(SAMPLE_COLUMN_NAMES.index(name) for name in _METRIC_NAMES)


def sample_from_row(values: Sequence) -> StepMetrics:
    """The inverse of sample_row: values in SAMPLE_COLUMNS order (e.g. a stored row's)."""
    return StepMetrics(
        config=_config(*values[_CONFIG_SLICE]),
        **{name: values[i] for name, i in zip(_METRIC_NAMES, _METRIC_POSITIONS)},
    )
