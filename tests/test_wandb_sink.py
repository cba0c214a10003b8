"""The offline wandb mirror: rows go in, the run is finished at close (its file complete), and a
disabled sink writes nothing."""

from __future__ import annotations

from vlmrun.observe.wandb_sink import WandbSink


def test_an_offline_run_is_written_and_finished(tmp_path, monkeypatch):
    import wandb

    monkeypatch.setenv("WANDB_SILENT", "true")
    sink = WandbSink(mode="offline", project="vlmrun-test", run_dir=tmp_path, name="t", run_id="sinktest1")
    assert sink.run is not None
    sink.log({"step": 1, "loss": 1.5, "note": "text is not a metric"})
    sink.log({"step": 2, "loss": 1.25})
    sink.close()
    assert wandb.run is None  # finished: wandb has no active run left in this process
    assert sink.run is None
    files = list(tmp_path.glob("wandb/offline-run-*/run-sinktest1.wandb"))
    assert len(files) == 1 and files[0].stat().st_size > 0, list(tmp_path.rglob("*"))


def test_a_disabled_sink_writes_nothing(tmp_path):
    sink = WandbSink(mode="disabled", project="vlmrun-test", run_dir=tmp_path, name="t", run_id="sinktest2")
    sink.log({"step": 1, "loss": 1.0})
    sink.close()
    assert list(tmp_path.iterdir()) == []
