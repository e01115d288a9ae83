"""Images in data rows (data.image_column): every accepted form read and checked as the data loads,
and each bad image named in one line with its row."""

import base64
import io
import json

import pytest
from PIL import Image

from rltrain.config import DataConfig
from rltrain.data import load_rows
from rltrain.media import ImageError, decoded, images_of
from rltrain.train import main


def png(width: int, height: int, colour: tuple[int, int, int]) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), colour).save(buffer, format="PNG")
    return buffer.getvalue()


def write_rows(folder, rows: list[dict]) -> str:
    path = folder / "rows.jsonl"
    path.write_text("".join(json.dumps({"prompt": "How many?", "answer": "1", **r}) + "\n" for r in rows))
    return str(path)


def test_every_accepted_form_loads_as_the_same_image(tmp_path):
    red, blue = png(8, 6, (255, 0, 0)), png(4, 4, (0, 0, 255))
    (tmp_path / "charts").mkdir()
    (tmp_path / "charts" / "red.png").write_bytes(red)
    b64 = base64.b64encode(red).decode()
    source = write_rows(tmp_path, [
        {"image": "charts/red.png"},  # relative to the data's folder
        {"image": f"data:image/png;base64,{b64}"},
        {"image": b64},  # bare base64
        {"image": [str(tmp_path / "charts" / "red.png"), f"data:image/png;base64,{base64.b64encode(blue).decode()}"]},
        {"image": None},  # a row without
    ])  # fmt: skip
    rows = load_rows(DataConfig(source=source, image_column="image"))
    assert [len(r["images"]) for r in rows] == [1, 1, 1, 2, 0]
    for row in rows[:4]:
        image = decoded(row["images"][0])
        assert image.size == (8, 6) and image.getpixel((3, 2)) == (255, 0, 0)
    assert decoded(rows[3]["images"][1]).getpixel((0, 0)) == (0, 0, 255)
    # a datasets Image column's forms: {"bytes", "path"} undecoded, a PIL image decoded
    assert images_of({"bytes": red, "path": None}, "here", 100) == [red]
    assert decoded(images_of(Image.open(io.BytesIO(blue)), "here", 100)[0]).getpixel((1, 1)) == (0, 0, 255)
    # text rows keep their two columns
    assert set(load_rows(DataConfig(source=source))[0]) == {"prompt", "answer"}


BAD = {
    "a missing file": ({"image": "charts/gone.png"}, "image file"),
    "bytes no decoder reads": ({"image": "charts/noise.png"}, "cannot be decoded as an image"),
    "a truncated image": ({"image": "charts/cut.png"}, "cannot be decoded as an image"),
    # 300 x 200 = 60,000 pixels against a limit of 50,000
    "too many pixels": (
        {"image": "charts/big.png"},
        "is 300x200 (60,000 pixels), over data.max_image_pixels=50,000",
    ),
    "a remote URL": ({"image": "https://example.com/a.png"}, "remote image URLs are not fetched"),
    "base64 that does not decode": (
        {"image": "data:image/png;base64,@@@"},
        "the image's base64 does not decode",
    ),
    "a number": ({"image": 7}, "got int"),
    "no such column": ({}, "has no column 'image' (data.image_column)"),
}


@pytest.mark.parametrize("case", BAD)
def test_a_bad_image_stops_the_load_naming_its_row(case, tmp_path):
    (tmp_path / "charts").mkdir()
    (tmp_path / "charts" / "noise.png").write_bytes(b"not an image at all")
    (tmp_path / "charts" / "cut.png").write_bytes(png(64, 64, (0, 255, 0))[:80])
    (tmp_path / "charts" / "big.png").write_bytes(png(300, 200, (0, 0, 0)))
    (tmp_path / "charts" / "ok.png").write_bytes(png(2, 2, (0, 0, 0)))
    bad, expected = BAD[case]
    source = write_rows(tmp_path, [{"image": "charts/ok.png"}, bad])
    with pytest.raises(ValueError) as raised:
        load_rows(DataConfig(source=source, image_column="image", max_image_pixels=50_000))
    message = str(raised.value)
    assert "rows.jsonl line 2" in message and expected in message and "\n" not in message, message
    if case != "no such column":
        assert isinstance(raised.value, ImageError) and "column 'image' (data.image_column)" in message


def test_the_cli_names_a_bad_image_in_one_line_and_refuses_images_for_a_text_model(
    tmp_path, capsys, monkeypatch
):
    import rltrain.run.launch

    monkeypatch.setattr(rltrain.run.launch, "connect_ray", lambda *_: pytest.fail("Ray was started"))
    (tmp_path / "ok.png").write_bytes(png(2, 2, (0, 0, 0)))
    argv = ["--config", "configs/cpu_demo.yaml", f"run.output_dir={tmp_path / 'run'}", "data.image_column=image",
            "sft_warmup.steps=0", "run.eval_every=0"]  # fmt: skip
    bad = write_rows(tmp_path, [{"image": "ok.png"}, {"image": "gone.png"}])
    assert main([*argv, f"data.source={bad}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "rows.jsonl line 2" in err and "does not exist" in err, err
    good = write_rows(tmp_path, [{"image": "ok.png"}])
    assert main([*argv, f"data.source={good}"]) == 2
    err = capsys.readouterr().err
    # builtin:tiny has no image processor: a run would have nowhere to put the images
    assert err.count("\n") == 1 and "images need a vision-language model" in err, err
    # an agent's rows would carry pictures it never sends (it sends its own, as image_url parts)
    agent = [
        "agent.entrypoint=gateway_agents:run",
        "rollout.tools.enabled=[]",
        "reward.functions={agent: 1.0}",
    ]
    assert main([*argv, f"data.source={good}", "model.name_or_path=builtin:tiny-vl", *agent]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "images are not taken with agent.entrypoint" in err, err
