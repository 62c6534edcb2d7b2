"""Bad inputs to the trace benchmarks are one line and exit status 2, before any run: a trace that holds no
requests, an Azure CSV without the columns it needs, and a --json/--plot path that cannot be written (which used
to be a traceback after the whole run, its results lost)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvmesh.cli import main

AZURE_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"


def mooncake(path: Path, rows: int = 4) -> Path:
    path.write_text("".join(json.dumps({"timestamp": 100 * i, "input_length": 1000, "output_length": 4,
                                        "hash_ids": [0, i + 1]}) + "\n" for i in range(rows)))
    return path


def azure(path: Path, rows: int = 3) -> Path:
    path.write_text(AZURE_HEADER + "".join(f"2023-11-16 18:15:{i:02d}.0000000,{300 + i},{10 + i}\n"
                                           for i in range(rows)))
    return path


def refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Run the CLI in-process; check it refused with one line on stderr and ran nothing; return that line."""
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"kvmesh bench {argv[1]}: "), err
    assert "|" not in out  # no table: the benchmark did not run
    return err.strip()


# ---- traces that hold no requests ---------------------------------------------------------------------------------


def test_cluster_on_an_empty_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (trace := tmp_path / "empty.jsonl").write_text("")
    line = refused(["bench", "cluster", "--trace", str(trace), "--instances", "2", "--prefill-speed", "1000"], capsys)
    assert f"trace {trace} holds no requests" in line


def test_cluster_on_a_trace_of_blank_lines(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (trace := tmp_path / "blank.jsonl").write_text("\n  \n\n")
    assert "holds no requests" in refused(["bench", "cluster", "--trace", str(trace), "--prefill-speed", "1000"],
                                          capsys)


@pytest.mark.parametrize("text", ["", AZURE_HEADER], ids=["empty", "header-only"])
def test_autoscale_on_an_empty_trace(text: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (trace := tmp_path / "empty.csv").write_text(text)
    assert f"trace {trace} holds no requests" in refused(["bench", "autoscale", "--trace", str(trace)], capsys)


def test_autoscale_scale_to_zero_on_an_empty_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (trace := tmp_path / "empty.csv").write_text(AZURE_HEADER)
    line = refused(["bench", "autoscale", "--scale-to-zero", "--trace", str(trace)], capsys)
    assert f"trace {trace} holds no requests" in line


@pytest.mark.parametrize("rows", [0, 2], ids=["header-only", "with-rows"])
def test_autoscale_on_a_csv_without_the_columns(rows: int, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "wrong.csv"
    trace.write_text("time,prompt,output\n" + "2023-11-16 18:15:00.0000000,300,10\n" * rows)
    line = refused(["bench", "autoscale", "--trace", str(trace)], capsys)
    assert str(trace) in line
    assert "TIMESTAMP, ContextTokens, GeneratedTokens" in line  # the columns it needs
    assert "'time', 'prompt', 'output'" in line  # and the ones it found


def test_serve_on_an_empty_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVMESH_INTERNAL_TOKEN_FILE", raising=False)
    (trace := tmp_path / "empty.jsonl").write_text("")
    line = refused(["bench", "serve", "--dataset", "trace", "--trace", str(trace), "--max-model-len", "4096",
                    "--url", "http://127.0.0.1:9"], capsys)
    assert f"trace {trace} holds no requests" in line


def test_eviction_on_an_empty_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (trace := tmp_path / "empty.jsonl").write_text("")
    line = refused(["bench", "eviction", "--trace", str(trace), "--sizes", "64"], capsys)
    assert f"trace {trace} holds no requests" in line


# ---- output paths that cannot be written, refused before the run --------------------------------------------------


@pytest.fixture
def bad_outputs(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "folder").mkdir()
    (tmp_path / "file").write_text("")
    return {"folder": f"{tmp_path / 'folder'}/", "folder-no-slash": str(tmp_path / "folder"),
            "under-a-file": str(tmp_path / "file" / "out.x"), "deep-under-a-file": str(tmp_path / "file" / "a" / "b.x")}


def expect_output_refused(line: str, flag: str, path: str) -> None:
    assert f"{flag} {path}: " in line
    assert "is a folder" in line or "cannot be written" in line


@pytest.mark.parametrize("which", ["folder", "folder-no-slash", "under-a-file", "deep-under-a-file"])
@pytest.mark.parametrize("flag", ["--json", "--plot"])
def test_cluster_bad_output(flag: str, which: str, bad_outputs: dict[str, str], tmp_path: Path,
                            capsys: pytest.CaptureFixture[str]) -> None:
    path = bad_outputs[which]
    line = refused(["bench", "cluster", "--trace", str(mooncake(tmp_path / "t.jsonl")), "--instances", "2",
                    "--prefill-speed", "4000", flag, path], capsys)
    expect_output_refused(line, flag, path)


@pytest.mark.parametrize(("flag", "zero"), [("--json", False), ("--plot", False), ("--json", True)],
                         ids=["json", "plot", "json-scale-to-zero"])
def test_autoscale_bad_output(flag: str, zero: bool, bad_outputs: dict[str, str], tmp_path: Path,
                              capsys: pytest.CaptureFixture[str]) -> None:
    path = bad_outputs["folder"] if flag == "--json" else bad_outputs["under-a-file"]
    argv = ["bench", "autoscale", *(["--scale-to-zero", "--pools", "1"] if zero else []),
            "--trace", str(azure(tmp_path / "a.csv")), "--initial", "1", "--hpa-targets", "0.8", flag, path]
    expect_output_refused(refused(argv, capsys), flag, path)


@pytest.mark.parametrize("which", ["folder", "under-a-file"])
def test_serve_bad_output(which: str, bad_outputs: dict[str, str], capsys: pytest.CaptureFixture[str],
                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVMESH_INTERNAL_TOKEN_FILE", raising=False)
    path = bad_outputs[which]  # port 9 refuses at once: the old code's run ended fast, then failed on the path
    line = refused(["bench", "serve", "--url", "http://127.0.0.1:9", "--num-requests", "1", "--input-tokens", "4",
                    "--output-tokens", "1", "--timeout", "5", "--json", path], capsys)
    expect_output_refused(line, "--json", path)


@pytest.mark.parametrize("which", ["folder", "under-a-file"])
def test_eviction_bad_output(which: str, bad_outputs: dict[str, str], tmp_path: Path,
                             capsys: pytest.CaptureFixture[str]) -> None:
    path = bad_outputs[which]
    line = refused(["bench", "eviction", "--trace", str(mooncake(tmp_path / "t.jsonl")), "--sizes", "64",
                    "--json", path], capsys)
    expect_output_refused(line, "--json", path)


def test_eviction_json_in_a_new_folder_is_written(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "new" / "deeper" / "e.json"  # a folder that does not exist yet is made, as the others do
    assert main(["bench", "eviction", "--trace", str(mooncake(tmp_path / "t.jsonl")), "--sizes", "64",
                 "--json", str(out)]) == 0
    assert json.loads(out.read_text())["requests"] == 4
    assert "| 64 |" in capsys.readouterr().out


def test_check_output_path(tmp_path: Path) -> None:
    from kvmesh.bench.plots import check_output_path

    check_output_path(None, "--json")
    check_output_path(tmp_path / "out.json", "--json")
    check_output_path(tmp_path / "not" / "yet" / "out.json", "--plot")  # made later, by the benchmark
    assert not (tmp_path / "not").exists()  # the check creates nothing
    (existing := tmp_path / "old.json").write_text("{}")
    check_output_path(existing, "--json")  # overwritten, as before
    with pytest.raises(ValueError, match=r"^--json .*: is a folder"):
        check_output_path(tmp_path, "--json")
    with pytest.raises(ValueError, match=r"^--plot .*old\.json/x\.png: cannot be written: .*old\.json is a file"):
        check_output_path(existing / "x.png", "--plot")
