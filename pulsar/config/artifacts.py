"""Every name a build, or a sweep, puts at the top of an output directory.

``output_name`` (the compiled model's file name) may take none of them: the model would overwrite
that artifact or be overwritten by it, and the build would still exit 0. The names are listed here
whatever options produce them, so a config cannot collide only when an option is later turned on;
``tests/config/test_output_names.py`` builds with many options and checks that nothing else appears.
"""

from __future__ import annotations

# name -> what it is (and which option writes it)
OUTPUT_DIR_ENTRIES: dict[str, str] = {
    "build_config.json": "the effective config",
    "build.log": "the build log",
    "build_failed.log": "the log of a failed build",
    "evaluation.json": "the evaluation report (evaluation.metric)",
    "frontend": "the folder of the optimized float model",
    "quant": "the folder of the quantized model, its config and precision reports",
    "compiler": "the folder of the compiler's reports and checks",
    "cache": "the calibration cache folder (when work_dir is the output dir)",
    ".pulsar.lock": "the lock of a running build",
    "trial.json": "a sweep trial's result (pulsar sweep)",
    "sweep.json": "the sweep's table (pulsar sweep)",
    "sweep.png": "the sweep's plot (pulsar sweep)",
    "sweep.html": "the sweep's report (pulsar sweep)",
    "trials": "the sweep's trial folders (pulsar sweep)",
    "work": "the sweep's shared work folder (pulsar sweep)",
}

# prefixes of names a running build uses: its lock and staging folders
RESERVED_PREFIXES: dict[str, str] = {".pulsar": "the lock and staging folders of a running build"}


def colliding_artifact(name: str) -> str | None:
    """``'<artifact>: <what it is>'`` when ``name`` is (or, on a case-insensitive file system, could
    be) the name of another artifact, else None."""
    folded = name.casefold()
    for entry, what in OUTPUT_DIR_ENTRIES.items():
        if entry.casefold() == folded:
            return f"{entry}, {what}"
    for prefix, what in RESERVED_PREFIXES.items():
        if folded.startswith(prefix):
            return f"{prefix}*, {what}"
    return None
