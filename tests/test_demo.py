"""The README's main job runs end to end (with a shorter fit) and writes its heatmap."""

from interp_engine.demo import main


def test_demo_runs_and_writes_the_logit_lens_png(tmp_path, capsys):
    main(["--out", str(tmp_path), "--train-steps", "20"])
    printed = capsys.readouterr().out
    for step in ("1. capture", "2. steer", "3. generate", "4. logit lens", "5. run_with_grad"):
        assert step in printed
    png = tmp_path / "logit_lens.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
