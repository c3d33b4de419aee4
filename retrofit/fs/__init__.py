"""File-system safety: atomic writes (the one writer of files), advisory locks, recognisable temporary folders,
guarded overwrites.

Depends on nothing else in retrofit but :mod:`retrofit.errors`, so every layer may use it.
"""
from retrofit.fs.atomic import (
    AppendLog, atomic_directory, atomic_file, fsync_dir, remove_directory, save_figure_atomic, write_bytes_atomic,
    write_json_atomic, write_text_atomic,
)
from retrofit.fs.guard import check_output_folder, check_replaceable, is_replaceable_checkpoint, special_kind
from retrofit.fs.locks import LockError, output_lock
from retrofit.fs.tempdirs import clean_stale_temps, make_temp_dir, pid_alive, terminate_on_sigterm

__all__ = [
    "AppendLog", "atomic_directory", "atomic_file", "fsync_dir", "remove_directory", "save_figure_atomic",
    "write_bytes_atomic", "write_json_atomic", "write_text_atomic",
    "LockError", "check_output_folder", "check_replaceable", "clean_stale_temps", "is_replaceable_checkpoint",
    "make_temp_dir", "output_lock", "pid_alive", "special_kind", "terminate_on_sigterm",
]
