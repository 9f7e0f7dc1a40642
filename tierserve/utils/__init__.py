"""Small facts every layer uses: sizes and their units, dtype names, ports and URLs, CPU flags,
console output, the packages' lazy faces, the test-only holds (layer 0). Plain imports:
nothing here loads more than the standard library."""

from tierserve.utils.console import JSON_SCHEMA_VERSION, emit
from tierserve.utils.cpuinfo import cpu_field, cpu_flags
from tierserve.utils.dtypes import (
    ALIASES,
    COMPUTE_DTYPES,
    DTYPES,
    DType,
    canonical,
    float8_of,
    torch_dtype,
)
from tierserve.utils.lazy import lazy_exports
from tierserve.utils.net import (
    bind_server_socket,
    check_port,
    check_url,
    free_port,
    listen_address,
)
from tierserve.utils.paths import unusable_dir
from tierserve.utils.test_hold import wait_while_held
from tierserve.utils.units import (
    GB,
    KB,
    MAX_SIZE,
    MB,
    TB,
    UNITS,
    GiB,
    KiB,
    MiB,
    TiB,
    format_bytes,
    format_count,
    format_gb,
    format_gib,
    parse_size,
)

__all__ = [
    "ALIASES",
    "COMPUTE_DTYPES",
    "DTYPES",
    "JSON_SCHEMA_VERSION",
    "MAX_SIZE",
    "UNITS",
    "DType",
    "bind_server_socket",
    "canonical",
    "check_port",
    "check_url",
    "cpu_field",
    "cpu_flags",
    "emit",
    "float8_of",
    "format_bytes",
    "format_count",
    "format_gb",
    "format_gib",
    "free_port",
    "lazy_exports",
    "listen_address",
    "parse_size",
    "torch_dtype",
    "unusable_dir",
    "wait_while_held",
]  # fmt: skip
