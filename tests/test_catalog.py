"""The error catalog: the build-time extractor (tools/catalog) on small packages built here, and the
run-time matcher (logdx.diagnose.catalog) on the catalog shipped in the package. No network, no models."""

from __future__ import annotations

import gzip
import io
import json
import sys
import tarfile
import textwrap
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tools/ is not installed: the builder runs from the checkout

from tools.catalog.build_catalog import build  # noqa: E402
from tools.catalog.extract_binary import nccl_sites  # noqa: E402
from tools.catalog.extract_native import extract_cxx, extract_cython, extract_rust  # noqa: E402
from tools.catalog.extract_python import PythonStats, extract_python  # noqa: E402
from tools.catalog.label import Labeller  # noqa: E402
from tools.catalog.templates import Site  # noqa: E402

from logdx.diagnose.catalog import CATALOG_PATH, FORMAT_VERSION, Catalog, catalog, catalog_meta  # noqa: E402
from logdx.testing import cpu_seconds  # noqa: E402

TINY_CORE = textwrap.dedent('''\
    """A module with raise sites of every form the extractor reads."""
    import os
    from .errors import ShardError
    from . import errors as errs

    MISSING = "the shard index file is missing from the dataset directory"


    class QuotaExceeded(RuntimeError):
        def __init__(self, used, limit):
            super().__init__(f"storage quota exceeded: used {used} of {limit} bytes")


    def load(path, rank, world):
        if not path:
            raise ValueError(f"rank {rank} got an empty shard path (world size {world})")
        if rank >= world:
            raise IndexError("rank %d is outside a world of %d processes" % (rank, world))
        if not os.path.exists(path):
            raise FileNotFoundError("shard {} was not found under {}".format(path, os.getcwd()))
        if path.endswith(".tmp"):
            raise RuntimeError("temporary shards cannot be loaded; wait for the writer to finish")
        msg = f"shard {path} is corrupt"
        msg += ", delete it and download it again"
        if path.endswith(".bad"):
            raise ShardError(msg)
        if path.endswith(".idx"):
            raise errs.ShardError(MISSING)
        if path.endswith(".big"):
            raise QuotaExceeded(10, 5)
        assert world > 0, f"world size must be positive, got {world}"
        try:
            return open(path)
        except OSError as err:
            if rank:
                raise
            raise err
''')
TINY_ERRORS = textwrap.dedent('''\
    class ShardError(Exception):
        """Raised for an unreadable shard."""


    def full():
        raise OSError("No space left on device while writing the shard cache")


    def oom():
        raise RuntimeError(f"CUDA out of memory. Tried to allocate {1} GiB")
''')


def _site(sites: list[Site], needle: str) -> Site:
    found = [s for s in sites if needle in s.template]
    assert found, f"no site with {needle!r} in {[s.template for s in sites]}"
    return found[0]


# ---- the Python extractor ------------------------------------------------------------------------

def test_python_extractor_reads_every_form_of_raise():
    stats = PythonStats()
    sites = extract_python(TINY_CORE, "tinypkg.core", "tinypkg/core.py", "tinypkg", False, stats)

    fstring = _site(sites, "got an empty shard path")
    assert fstring.template == "rank <*> got an empty shard path (world size <*>)"
    assert (fstring.exception, fstring.qualified, fstring.module) == ("ValueError", "ValueError", "tinypkg.core")
    assert fstring.file == "tinypkg/core.py" and fstring.line == 16

    assert _site(sites, "outside a world").template == "rank <*> is outside a world of <*> processes"
    assert _site(sites, "was not found").template == "shard <*> was not found under <*>"
    constant = _site(sites, "temporary shards")
    assert constant.template == "temporary shards cannot be loaded; wait for the writer to finish"
    # A message built in a variable, then appended to, before the raise.
    built = _site(sites, "is corrupt")
    assert built.template == "shard <*> is corrupt, delete it and download it again"
    assert built.qualified == "tinypkg.errors.ShardError"  # resolved through the relative import
    aliased = _site(sites, "index file is missing")
    assert aliased.exception == "errs.ShardError" and aliased.qualified == "tinypkg.errors.ShardError"
    # The custom class of this module: its own message template, and the raise site that uses it.
    own = _site(sites, "storage quota exceeded")
    assert own.template == "storage quota exceeded: used <*> of <*> bytes"
    assert own.qualified == "tinypkg.core.QuotaExceeded" and own.extra.get("class_template")
    assert _site(sites, "world size must be positive").exception == "AssertionError"
    # `raise` and `raise err` re-raise what was caught: no new message, no site.
    assert stats.reraises == 2
    assert all(s.template for s in sites if s.exception != "QuotaExceeded")


def test_python_extractor_skips_files_it_cannot_parse():
    stats = PythonStats()
    assert extract_python("def broken(:\n", "m", "m.py", "p", False, stats) == []
    assert stats.unparsable_files == 1


def test_native_extractors():
    cxx = extract_cxx(textwrap.dedent('''\
        // TORCH_CHECK(false, "in a comment: never a site");
        #define TORCH_CHECK(cond, ...) if (!(cond)) throw
        void f(int64_t dim) {
          TORCH_CHECK(dim >= 0, "dimension ", dim, " must be non-negative, got a tensor of ",
                      "rank ", t.dim());
          TORCH_CHECK_VALUE(ok, "invalid value for the reduction");
          C10_THROW_ERROR(DistBackendError, "NCCL communicator was aborted on rank ", rank);
          return arrow::Status::Invalid("Could not convert ", obj, " with type ", type);
        }
        '''), "x.h", "torch", "torch._C")
    assert [(s.template, s.qualified, s.line) for s in cxx] == [
        ("dimension <*> must be non-negative, got a tensor of rank <*>", "RuntimeError", 4),
        ("invalid value for the reduction", "ValueError", 6),
        ("NCCL communicator was aborted on rank <*>", "torch.distributed.DistBackendError", 7),
        ("Could not convert <*> with type <*>", "pyarrow.lib.ArrowInvalid", 8),
    ]
    cython = extract_cython(textwrap.dedent('''\
        cdef class Table:
            cdef int n
            def column(self, int i):
                msg = f"Column index {i} out of bounds for a table of {self.n} columns"
                if i >= self.n:
                    raise ArrowIndexError(msg)
                return <object> self.columns[i]
        '''), "table.pxi", "pyarrow", "pyarrow.lib", "pyarrow.lib", PythonStats())
    assert [(s.template, s.qualified, s.line) for s in cython] == [
        ("Column index <*> out of bounds for a table of <*> columns", "pyarrow.lib.ArrowIndexError", 6)]
    rust = extract_rust(textwrap.dedent('''\
        let e = SafetensorError::new_err(format!("Error while deserializing header: {err}"));
        Err(PyFileNotFoundError::new_err("File does not exist on disk".to_string()))
        '''), "lib.rs", "safetensors", "safetensors._safetensors_rust")
    assert [(s.template, s.exception) for s in rust] == [
        ("Error while deserializing header: <*>", "SafetensorError"),
        ("File does not exist on disk", "FileNotFoundError")]


def test_nccl_strings_keep_failure_formats_only():
    blob = b"\0".join([
        b"NET/IB : Got completion from peer %s with status=%d opcode=%d len=%d vendor err %d (%s)",
        b"%s:%d -> %d [Proxy Thread]: Call to connect failed: %s",
        b"NCCL_IB_HCA", b"ncclCommInitRank", b"Bootstrap : Using %s", b"/usr/lib/x86_64-linux-gnu",
    ])
    templates = [s.template for s in nccl_sites(blob, "libnccl.so.2", "nvidia-nccl-cu12")]
    assert templates == ["NET/IB : Got completion from peer <*> with status=<*> opcode=<*> len=<*> vendor err <*> (<*>)",
                         "[Proxy Thread]: Call to connect failed: <*>"]


def test_labels_come_from_rules_then_the_taxonomy_owners():
    labeller = Labeller.load()

    def label(**kw: object) -> tuple[str, str]:
        lab = labeller.label(Site(**{"source": "python", "package": "p", "template": "", **kw}))  # type: ignore[arg-type]
        return lab.failure_type, lab.by.partition(":")[0]

    assert label(template="failed to write: No space left on device", module="torch.serialization") == ("disk_full", "rule")
    assert label(template="cannot read the archive at <*>", module="torch.serialization") == ("checkpoint_error", "owner")
    assert label(template="Column <*> is not in the schema", module="datasets.arrow_dataset") == ("dataset_loading_error", "owner")
    assert label(template="undefined symbol: <*>", exception="ImportError", module="deepspeed.ops") == ("version_mismatch", "rule")
    assert label(template="batch size must be positive", module="tinypkg.core") == ("config_error", "library_default")
    assert label(source="nccl", template="NET/Socket : Connection closed by remote peer <*>") == ("network_error", "rule")
    assert label(source="nccl", template="Proxy call to rank <*> failed (Setup)") == ("nccl_error", "source")
    assert label(source="cudart", template="uncorrectable ECC error encountered") == ("ecc_error", "rule")
    assert label(source="cudart", template="out of memory") == ("cuda_oom", "rule")
    assert label(source="cudart", template="an illegal memory access was encountered") == ("cuda_error", "source")


# ---- the whole build, from local release files (what `make catalog` does with PyPI's) -------------

def _tiny_wheel(path: Path) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("tinypkg/__init__.py", "from .core import load\n")
        zf.writestr("tinypkg/core.py", TINY_CORE)
        zf.writestr("tinypkg/errors.py", TINY_ERRORS)
        zf.writestr("tinypkg/tests/test_core.py", "def test():\n    raise ValueError('a test, never read into the catalog')\n")
        zf.writestr("tinypkg-0.1.dist-info/METADATA", "Metadata-Version: 2.1\nName: tinypkg\nVersion: 0.1\n")
    return path


def _tiny_sdist(path: Path) -> Path:
    files = {
        "tinyext-0.2/PKG-INFO": "Name: tinyext\nVersion: 0.2\n",
        "tinyext-0.2/src/tinyext/__init__.py": "",
        "tinyext-0.2/src/tinyext/shards.py": "def f(n):\n    raise KeyError(f'shard {n} is not in the shard index')\n",
        "tinyext-0.2/csrc/kernel.h": 'TORCH_CHECK(n > 0, "expected a positive shard count, got ", n);\n',
    }
    with tarfile.open(path, "w:gz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def _sources(tmp_path: Path) -> Path:
    (tmp_path / "xid.toml").write_text(textwrap.dedent('''\
        [[xid]]
        code = 79
        description = "GPU has fallen off the bus"
        implicates = "hardware"
        failure_type = "gpu_fell_off_bus"
        role = "root_cause"
        messages = ["GPU has fallen off the bus"]
        '''))
    sources = tmp_path / "sources.toml"
    sources.write_text(textwrap.dedent(f'''\
        exclude = ["*/tests/*"]

        [[package]]
        name = "tinypkg"
        version = "0.1"
        path = "{_tiny_wheel(tmp_path / 'tinypkg-0.1-py3-none-any.whl')}"
        modules = ["tinypkg"]
        extract = ["python"]

        [[package]]
        name = "tinyext"
        version = "0.2"
        path = "{_tiny_sdist(tmp_path / 'tinyext-0.2.tar.gz')}"
        modules = ["tinyext"]
        extract = ["python", "cxx"]
        native_module = "tinyext._C"

        [xid]
        file = "xid.toml"
        '''))
    return sources


def test_build_from_local_release_files(tmp_path):
    sources = _sources(tmp_path)
    out, meta_path = tmp_path / "out" / "catalog.jsonl.gz", tmp_path / "out" / "catalog.meta.json"
    meta = build(sources, out, meta_path, tmp_path / "cache", offline=True)

    with gzip.open(out, "rt", encoding="utf-8") as f:
        entries = [json.loads(line) for line in f]
    by_template = {e["template"]: e for e in entries}
    shard = by_template["shard <*> is corrupt, delete it and download it again"]
    assert shard["module"] == "tinypkg.core" and shard["qualified"] == "tinypkg.errors.ShardError"
    assert shard["site"] == "tinypkg/core.py:26"
    assert (shard["failure_type"], shard["category"], shard["label_by"]) == ("config_error", "framework", "library_default")
    assert by_template["No space left on device while writing the shard cache"]["failure_type"] == "disk_full"
    assert by_template["CUDA out of memory. Tried to allocate <*> GiB"]["failure_type"] == "cuda_oom"
    assert by_template["shard <*> is not in the shard index"]["module"] == "tinyext.shards"  # under src/ in the sdist
    native = by_template["expected a positive shard count, got <*>"]
    assert (native["source"], native["module"], native["exception"]) == ("cxx", "tinyext._C", "RuntimeError")
    xid = next(e for e in entries if e["source"] == "xid")
    assert (xid["code"], xid["failure_type"], xid["hardware"]) == (79, "gpu_fell_off_bus", True)
    assert not any("a test, never read" in e["template"] for e in entries)  # tests/ excluded

    assert meta["format"] == FORMAT_VERSION and meta["entries"] == len(entries)
    assert [(s["name"], s["version"], s["origin"]) for s in meta["sources"][:2]] == [("tinypkg", "0.1", "local"),
                                                                                    ("tinyext", "0.2", "local")]
    assert meta["counts"]["by_source"] == {"cxx": 1, "python": len(entries) - 2, "xid": 1}
    assert json.loads(meta_path.read_text()) == meta

    # Rerunnable: the same sources give the same bytes.
    first = out.read_bytes()
    build(sources, out, meta_path, tmp_path / "cache", offline=True)
    assert out.read_bytes() == first

    # And the matcher reads what the builder wrote.
    hits = Catalog.load(out).match("tinypkg.errors.ShardError: shard /data/s-0001.arrow is corrupt, delete it and download it again")
    assert hits and hits[0].entry.id == shard["id"] and hits[0].how == "template"


def test_offline_build_without_the_release_file_fails_clearly(tmp_path):
    from tools.catalog.build_catalog import main

    sources = tmp_path / "sources.toml"
    sources.write_text('[[package]]\nname = "x"\nversion = "1"\nfile = "x-1-py3-none-any.whl"\nmodules = ["x"]\n'
                       'extract = ["python"]\n')
    assert main(["--sources", str(sources), "--out", str(tmp_path / "c.jsonl.gz"), "--cache", str(tmp_path),
                 "--offline"]) == 2


# ---- the shipped catalog ---------------------------------------------------------------------------

@pytest.mark.slow
def test_shipped_catalog_is_versioned_and_bounded():
    meta = catalog_meta()
    assert meta["format"] == FORMAT_VERSION
    assert CATALOG_PATH.stat().st_size <= 4 * 1024 * 1024
    versions = {s["name"]: s.get("version") for s in meta["sources"]}
    assert versions["torch"].startswith("2.13.0")
    assert {"deepspeed", "transformers", "accelerate", "datasets", "megatron-core", "triton", "pyarrow",
            "safetensors", "nvidia-nccl-cu12", "nvidia-cuda-runtime-cu12", "xid"} <= set(versions)
    assert len(catalog()) == meta["entries"]
    templates = [(e.template, e.qualified or e.exception or "") for e in catalog().entries]
    assert len(templates) == len(set(templates))  # de-duplicated
    assert all(e.template.strip(" <*>") for e in catalog().entries)  # never only a wildcard


@pytest.mark.parametrize(("line", "module", "exception", "failure_type"), [
    ("deepspeed.runtime.zero.utils.ZeRORuntimeException: The checkpoint being loaded used a DP world size of 8 "
     "but the current world size is 16. Automatic adjustment of ZeRO's optimizer state partitioning with a new "
     "world size is not currently supported.",
     "deepspeed.runtime.engine", "ZeRORuntimeException", "checkpoint_error"),
    ("pyarrow.lib.ArrowInvalid: Could not convert '12a' with type str: tried to convert to int64",
     "pyarrow.lib", "ArrowInvalid", "dataset_loading_error"),
    ("triton.runtime.errors.OutOfResources: out of resource: shared memory, Required: 131072, Hardware limit: "
     "101376. Reducing block sizes or `num_stages` may help.",
     "triton.runtime.errors", "OutOfResources", "framework_error"),
    ("safetensors_rust.SafetensorError: Error while deserializing header: HeaderTooLarge",
     "safetensors._safetensors_rust", "SafetensorError", "checkpoint_error"),
])
def test_framework_errors_match_their_raise_site(line, module, exception, failure_type):
    hit = catalog().match(line)[0]
    assert hit.how == "template" and hit.score >= 0.8
    assert (hit.entry.module, hit.entry.exception_name, hit.entry.failure_type) == (module, exception, failure_type)


def test_nccl_ib_warning_is_a_network_error():
    line = ("NET/IB: Got completion from peer 10.0.0.12<54321> with status=12(transport retry counter exceeded) "
            "opcode=0(SEND) vendor_err=129 qp_num=1234 hca mlx5_0")
    hit = catalog().match(line)[0]
    assert (hit.entry.source, hit.entry.failure_type, hit.entry.category) == ("nccl", "network_error", "infrastructure")


def test_cuda_runtime_strings_and_names():
    hit = catalog().match("RuntimeError: CUDA error: an illegal memory access was encountered")[0]
    assert (hit.entry.source, hit.entry.name, hit.entry.failure_type) == ("cudart", "cudaErrorIllegalAddress", "cuda_error")
    ecc = catalog().match("RuntimeError: CUDA error: uncorrectable ECC error encountered")[0]
    assert ecc.entry.failure_type == "ecc_error"
    named = catalog().match("CUDA call failed: cudaErrorIllegalAddress (700)")[0]
    assert (named.how, named.entry.code) == ("symbol", 700)


def test_xid_lines_are_found_by_code():
    hit = catalog().match("[ 1234.5] NVRM: Xid (PCI:0000:b3:00): 79, pid=0, name=python, GPU has fallen off the bus.")[0]
    assert (hit.how, hit.entry.code, hit.entry.failure_type, hit.entry.hardware) == ("xid", 79, "gpu_fell_off_bus", True)
    app = catalog().match("NVRM: Xid (PCI:0000:3b:00): 13, pid=4242, name=python, Graphics SM Warp Exception")[0]
    assert (app.entry.implicates, app.entry.category) == ("application", "framework")


@pytest.mark.parametrize("line", [
    "iteration      100/  100000 | consumed samples: 102400 | elapsed time per iteration (ms): 1234.5 | lm loss: 2.345E+00",
    "Epoch 3: 100%|##########| 500/500 [01:23<00:00, 6.01it/s, loss=0.123, v_num=7]",
    "Loading checkpoint shards: 100%|##########| 4/4 [00:12<00:00,  3.01s/it]",
    "INFO:     Uvicorn running on http://0.0.0.0:8000 (Press CTRL+C to quit)",
    "Traceback (most recent call last):",
    "IndexError: list index out of range",  # Python's own message: no library is where it comes from
    "",
])
def test_lines_that_are_not_known_errors_match_nothing(line):
    assert catalog().match(line) == []


def test_matching_is_fast():
    lines = [
        "deepspeed.runtime.zero.utils.ZeRORuntimeException: The checkpoint being loaded used a DP world size of 8",
        "pyarrow.lib.ArrowInvalid: Could not convert '12a' with type str: tried to convert to int64",
        "iteration 100/1000 | lm loss 2.345 | lr 1e-4 | elapsed time per iteration (ms): 1234.5",
        "[rank3]: RuntimeError: CUDA error: an illegal memory access was encountered",
        "2024-01-02 03:04:05 INFO saving checkpoint to /ckpt/step_1000",
    ] * 40
    cat = catalog()
    for line in lines:  # compile what these lines need once
        cat.match(line)
    with cpu_seconds() as cpu:
        for line in lines:
            cat.match(line)
    per_line_ms = cpu.seconds * 1000 / len(lines)
    assert per_line_ms < 5, per_line_ms  # ~0.2 ms of CPU a line
