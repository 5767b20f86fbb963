"""The README's main job runs end to end (with a shorter fit) and writes its pictures."""

from interp_engine.demo import main


def test_demo_runs_and_writes_its_pngs(tmp_path, capsys):
    main(["--out", str(tmp_path), "--train-steps", "20"])
    printed = capsys.readouterr().out
    for step in ("1. capture", "2. steer", "3. generate", "4. logit lens", "5. run_with_grad", "6. pictures"):
        assert step in printed
    for name in ("logit_lens.png", "attention_layer0.png", "steering_norms.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
