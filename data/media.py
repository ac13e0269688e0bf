"""Probe, decode and re-encode images (Pillow) and videos (PyAV) held as bytes.

Every failure raises `MediaError` with a one-line reason that the builder reports and the
pipeline puts next to the record's shard and index. Decoding converts to RGB the way the M3
processors do (Pillow's `convert("RGB")`; no EXIF rotation, as in HF).
"""

import dataclasses
import fractions
import io
import math
import warnings
from collections.abc import Iterable

import av
import numpy as np
import PIL.Image

# Formats kept as they are; anything else Pillow can read (GIF, BMP, TIFF, ...) becomes PNG.
_PIL_TO_IMAGE_FORMAT = {"JPEG": "jpeg", "PNG": "png", "WEBP": "webp"}
_CONTAINER_TO_VIDEO_FORMAT = {"mov,mp4,m4a,3gp,3g2,mj2": "mp4", "matroska,webm": "webm"}


class MediaError(ValueError):
    """An image or video that cannot be used; the message is the reason."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class MediaLimits:
    """Caps applied by the builder: larger media are re-encoded to fit, never rejected for size."""

    max_image_pixels: int = 4096 * 4096
    max_image_bytes: int = 16 << 20
    max_video_pixels: int = 1280 * 720  # per frame
    max_video_seconds: float = 300.0
    max_video_fps: float = 30.0
    max_video_bytes: int = 256 << 20
    jpeg_quality: int = 92


@dataclasses.dataclass(frozen=True)
class VideoInfo:
    format: str  # "mp4", "webm", or FFmpeg's name of another container
    fps: float
    num_frames: int
    height: int
    width: int

    @property
    def duration(self) -> float:
        return self.num_frames / self.fps


# ---------------------------------------------------------------------------------------------
# Images.


def open_image(data: bytes) -> PIL.Image.Image:
    """Returns a fully loaded Pillow image; MediaError if the bytes are not a decodable image."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", PIL.Image.DecompressionBombWarning)
            image = PIL.Image.open(io.BytesIO(data))
            image.load()
    except PIL.UnidentifiedImageError:
        raise MediaError("undecodable image (not a format Pillow recognises)") from None
    except Exception as e:  # Pillow raises many types for broken files
        raise MediaError(f"undecodable image ({type(e).__name__}: {e})") from None
    if image.width < 1 or image.height < 1:
        raise MediaError(f"empty image ({image.width}x{image.height})")
    return image


def decode_image(data: bytes) -> np.ndarray:
    """uint8 RGB [H, W, 3] of encoded image bytes."""
    image = open_image(data)
    return np.asarray(image if image.mode == "RGB" else image.convert("RGB"))


def fit_image(data: bytes, limits: MediaLimits) -> tuple[bytes, str, int, int, str | None]:
    """Returns (bytes, format, height, width, note): the image as stored in a record.

    JPEG, PNG and WebP within the limits are kept byte for byte. Other formats are re-encoded as
    PNG; images over max_image_pixels are downscaled (Lanczos) to fit; files over max_image_bytes
    are re-encoded as JPEG. `note` says what was changed (None when nothing was).
    """
    image = open_image(data)
    kind = _PIL_TO_IMAGE_FORMAT.get(image.format or "")
    notes = []
    if image.width * image.height > limits.max_image_pixels:
        scale = math.sqrt(limits.max_image_pixels / (image.width * image.height))
        size = (max(1, int(image.width * scale)), max(1, int(image.height * scale)))
        notes.append(f"downscaled {image.width}x{image.height} -> {size[0]}x{size[1]}")
        image = image.convert("RGBA" if _has_alpha(image) else "RGB").resize(
            size, PIL.Image.LANCZOS
        )
        kind = None
    if kind is None:
        kind = "png"
        data = _encode_pil(image, "PNG", limits)
        notes.append("re-encoded as png")
    if len(data) > limits.max_image_bytes:
        kind = "jpeg"
        data = _encode_pil(image.convert("RGB"), "JPEG", limits)
        notes.append(f"re-encoded as jpeg (over {limits.max_image_bytes} bytes)")
        if len(data) > limits.max_image_bytes:
            raise MediaError(f"image still {len(data)} bytes after re-encoding")
    return data, kind, image.height, image.width, "; ".join(notes) or None


def _has_alpha(image: PIL.Image.Image) -> bool:
    return image.mode in ("RGBA", "LA", "PA") or "transparency" in image.info


def _encode_pil(image: PIL.Image.Image, fmt: str, limits: MediaLimits) -> bytes:
    if fmt == "PNG" and image.mode not in ("RGB", "RGBA", "L", "LA", "P"):
        image = image.convert("RGBA" if _has_alpha(image) else "RGB")
    buffer = io.BytesIO()
    options = {"quality": limits.jpeg_quality} if fmt == "JPEG" else {}
    image.save(buffer, format=fmt, **options)
    return buffer.getvalue()


# ---------------------------------------------------------------------------------------------
# Videos.


def probe_video(data: bytes) -> VideoInfo:
    """Decodes every frame once; returns the container format, fps, exact frame count and size."""
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            if not container.streams.video:
                raise MediaError("no video stream")
            stream = container.streams.video[0]
            fmt = _CONTAINER_TO_VIDEO_FORMAT.get(container.format.name, container.format.name)
            rate = stream.average_rate or stream.guessed_rate
            num_frames = 0
            height = width = 0
            for frame in container.decode(stream):
                num_frames += 1
                height, width = frame.height, frame.width
    except MediaError:
        raise
    except Exception as e:  # PyAV raises av.error.* and others for damaged files
        raise MediaError(f"undecodable video ({type(e).__name__}: {e})") from None
    if num_frames == 0:
        raise MediaError("video has no decodable frames")
    if not rate or float(rate) <= 0:
        raise MediaError("video has no frame rate")
    return VideoInfo(fmt, float(rate), num_frames, height, width)


def decode_video_frames(data: bytes, keep: Iterable[int]) -> np.ndarray:
    """uint8 RGB [F, H, W, 3]: the frames at decode positions `keep` (sorted, may repeat)."""
    keep = np.asarray(list(keep), dtype=np.int64)
    wanted = set(keep.tolist())
    last = int(keep.max()) if keep.size else -1
    found: dict[int, np.ndarray] = {}
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            stream = container.streams.video[0]
            stream.thread_type = "AUTO"
            for position, frame in enumerate(container.decode(stream)):
                if position in wanted:
                    found[position] = frame.to_ndarray(format="rgb24")
                if position >= last:
                    break
    except Exception as e:
        raise MediaError(f"undecodable video ({type(e).__name__}: {e})") from None
    missing = sorted(wanted - set(found))
    if missing:
        raise MediaError(f"video ended before frame {missing[0]} (decoded {len(found)} frames)")
    return np.stack([found[int(i)] for i in keep])


def fit_video(data: bytes, limits: MediaLimits) -> tuple[bytes, VideoInfo, str | None]:
    """Returns (bytes, info, note): the video as stored; re-encoded (H.264 MP4) when over a cap.

    Over max_video_seconds: cut; over max_video_fps: frames dropped to that rate; over
    max_video_pixels: downscaled keeping the aspect (even sides); over max_video_bytes: re-encoded.
    """
    info = probe_video(data)
    notes = []
    fps = min(info.fps, limits.max_video_fps)
    if fps < info.fps:
        notes.append(f"fps {info.fps:g} -> {fps:g}")
    height, width = info.height, info.width
    if height * width > limits.max_video_pixels:
        scale = math.sqrt(limits.max_video_pixels / (height * width))
        height, width = max(2, int(height * scale) // 2 * 2), max(2, int(width * scale) // 2 * 2)
        notes.append(f"downscaled {info.width}x{info.height} -> {width}x{height}")
    if info.duration > limits.max_video_seconds:
        notes.append(f"cut {info.duration:.1f} s -> {limits.max_video_seconds:g} s")
    if info.format not in ("mp4", "webm"):
        notes.append(f"container {info.format} re-encoded as mp4")
    if not notes and len(data) <= limits.max_video_bytes:
        return data, info, None
    if not notes:
        notes.append(f"re-encoded (over {limits.max_video_bytes} bytes)")
    max_frames = max(1, int(limits.max_video_seconds * fps))
    keep = sample_positions(info.num_frames, info.fps, fps)[:max_frames]
    frames = decode_video_frames(data, keep)
    data = encode_video(frames, fps, height=height, width=width)
    info = probe_video(data)
    if len(data) > limits.max_video_bytes:
        raise MediaError(f"video still {len(data)} bytes after re-encoding")
    return data, info, "; ".join(notes)


def sample_positions(num_frames: int, fps: float, target_fps: float) -> np.ndarray:
    """Decode positions that resample a clip from `fps` to `target_fps` <= fps."""
    count = max(1, int(num_frames * target_fps / fps))
    return np.arange(count, dtype=np.int64) * num_frames // count


def encode_video(
    frames: np.ndarray, fps: float, *, height: int | None = None, width: int | None = None
) -> bytes:
    """H.264 MP4 (yuv420p, crf 23) of uint8 RGB frames [F, H, W, 3], optionally rescaled."""
    height = height or frames.shape[1] // 2 * 2
    width = width or frames.shape[2] // 2 * 2
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=_rate(fps))
        stream.height, stream.width, stream.pix_fmt = height, width, "yuv420p"
        stream.options = {"crf": "23", "preset": "veryfast"}
        for pixels in frames:
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(pixels), format="rgb24")
            if (frame.height, frame.width) != (height, width):
                frame = frame.reformat(width=width, height=height, interpolation="AREA")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buffer.getvalue()


def _rate(fps: float) -> fractions.Fraction:
    return fractions.Fraction(fps).limit_denominator(1001)
