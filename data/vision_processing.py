"""MiniMax-M3 image and video processing: resize, normalise, patchify, chunk (spec §6, §4.3).

Reproduces `MiniMaxM3VLImageProcessor` / `MiniMaxM3VLVideoProcessor` (transformers 5.23, torchvision
backend) in NumPy, without torch:

- `smart_resize` picks a size that is a multiple of 28 (= patch · merge) within a pixel budget;
- pixels are resized as uint8 with torchvision's antialiased bicubic (`data/bicubic.py`, bit-exact
  with torch's CPU kernel), then rescaled and normalised in float32 exactly as HF fuses it:
  (x - 255·mean) / (255·std) with float32 constants;
- patchify orders rows block-major over 2×2 merge windows and features as (c, t, y, x); an image's
  single frame is repeated to fill the temporal patch;
- videos: frames sampled at `video_fps` with HF's uniform sampler, each frame resized with
  `smart_resize` (the video processor's own resize; the combined HF processor turns it off and
  expects multiples of 28), an odd frame count padded by repeating the last frame, and the grid
  split into chunks of at most `chunk_temporal_patches` temporal patches (ViT attention units).

Shapes: F frames, H/W pixels, C = 3 channels, T = temporal_patch_size, P = patch_size,
m = spatial_merge_size, D = C·T·P·P = 1176 features per patch row.
"""

import dataclasses
import math

import numpy as np

from batch_format.vision import patch_dim
from data.bicubic import resize_bicubic_uint8

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MAX_ASPECT_RATIO = 200


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProcessorConfig:
    """Processor settings; the defaults are M3's (HF 5.23 image and video processors).

    The pixel budgets count pixels, not edges (HF's size dict keys `shortest_edge` /
    `longest_edge` hold pixel counts). `video_fps` is the sampling rate (HF's `fps` with
    `do_sample_frames=True`); None keeps every decoded frame. `max_video_frames` caps the
    sampled frame count (HF declares max_frames=768 but never applies it; we do).
    """

    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    image_min_pixels: int = 4 * 28 * 28  # 3136
    image_max_pixels: int = 576 * 28 * 28  # 451584 = 672²
    video_min_pixels: int = 4 * 28 * 28
    video_max_pixels: int = 768 * 28 * 28  # 602112, per frame
    video_fps: float | None = 1.0
    max_video_frames: int = 768
    chunk_temporal_patches: int = 4  # HF vision_segment_max_frames
    timestamps: bool = True  # "]<]{t:.1f} seconds[>[" before each temporal patch

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if type(value) is int and value < 1:
                raise ValueError(f"ProcessorConfig.{field.name}={value} must be >= 1")
        if self.video_fps is not None and not self.video_fps > 0:
            raise ValueError(f"ProcessorConfig.video_fps={self.video_fps} must be > 0 or None")
        for kind in ("image", "video"):
            low, high = getattr(self, f"{kind}_min_pixels"), getattr(self, f"{kind}_max_pixels")
            if low > high:
                raise ValueError(
                    f"ProcessorConfig: {kind}_min_pixels={low} > {kind}_max_pixels={high}"
                )

    @property
    def factor(self) -> int:
        return self.patch_size * self.spatial_merge_size

    @property
    def patch_dim(self) -> int:
        return patch_dim(self.temporal_patch_size, self.patch_size)


@dataclasses.dataclass(frozen=True)
class VisionItem:
    """One ViT attention unit: an image, or one chunk of a video.

    patches [N, D] float32 in block-major order; grid (t, h, w) in patches, N = t·h·w;
    timestamps: one string per temporal patch for video chunks (empty for images or when off).
    """

    patches: np.ndarray
    grid: tuple[int, int, int]
    timestamps: tuple[str, ...] = ()


def smart_resize(height: int, width: int, *, factor: int, min_pixels: int, max_pixels: int):
    """Returns (height, width), multiples of `factor`, near the input aspect, within the budget.

    Raises ValueError when the aspect ratio exceeds 200 (as HF does).
    """
    if height < 1 or width < 1:
        raise ValueError(f"image size must be positive, got {height}x{width}")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(
            f"aspect ratio {max(height, width) / min(height, width):.1f} of {height}x{width} "
            f"exceeds {MAX_ASPECT_RATIO}"
        )
    new_height = round(height / factor) * factor  # Python round: half to even, like HF
    new_width = round(width / factor) * factor
    if new_height * new_width > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        new_height = max(factor, math.floor(height / beta / factor) * factor)
        new_width = max(factor, math.floor(width / beta / factor) * factor)
    elif new_height * new_width < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        new_height = math.ceil(height * beta / factor) * factor
        new_width = math.ceil(width * beta / factor) * factor
    return new_height, new_width


def normalize(pixels: np.ndarray) -> np.ndarray:
    """uint8 [..., H, W, C] -> float32, HF's fused rescale + CLIP normalisation (float32 math)."""
    mean = np.asarray(CLIP_MEAN, np.float32) * np.float32(255.0)
    std = np.asarray(CLIP_STD, np.float32) * np.float32(255.0)
    return (pixels.astype(np.float32) - mean) / std


def patchify(
    frames: np.ndarray, config: ProcessorConfig
) -> tuple[np.ndarray, tuple[int, int, int]]:
    """float32 frames [F, H, W, C] (F a multiple of T) -> (patches [N, D], grid (t, h, w)).

    Rows: for t, for block row, for block col, for row in block, for col in block (§4.3).
    Features: (c, t, y, x), the layout of the Conv3d patch embedding's kernel.
    """
    T, P, m = config.temporal_patch_size, config.patch_size, config.spatial_merge_size
    num_frames, height, width, channels = frames.shape
    if num_frames % T or height % (P * m) or width % (P * m):
        raise ValueError(
            f"patchify needs frames multiple of {T} and sides multiple of {P * m}, "
            f"got {num_frames} frames of {height}x{width}"
        )
    grid_t, grid_h, grid_w = num_frames // T, height // P, width // P
    x = frames.reshape(grid_t, T, grid_h // m, m, P, grid_w // m, m, P, channels)
    # axes: 0 t, 1 T, 2 block row, 3 row in block, 4 y, 5 block col, 6 col in block, 7 x, 8 c
    x = x.transpose(0, 2, 5, 3, 6, 8, 1, 4, 7)
    return np.ascontiguousarray(x).reshape(grid_t * grid_h * grid_w, -1), (grid_t, grid_h, grid_w)


def process_image(rgb: np.ndarray, config: ProcessorConfig) -> VisionItem:
    """uint8 RGB [H, W, 3] -> the image's VisionItem (grid (1, h, w), frame repeated T times)."""
    height, width = smart_resize(
        rgb.shape[0],
        rgb.shape[1],
        factor=config.factor,
        min_pixels=config.image_min_pixels,
        max_pixels=config.image_max_pixels,
    )
    pixels = normalize(resize_bicubic_uint8(rgb, height, width))
    frames = np.repeat(pixels[None], config.temporal_patch_size, axis=0)
    patches, grid = patchify(frames, config)
    return VisionItem(patches, grid)


def sample_frame_indices(total_frames: int, native_fps: float | None, config: ProcessorConfig):
    """Indices of the frames to keep: HF's uniform sampler at `config.video_fps`.

    n = max(1, int(total / native_fps · fps)), at most total and max_video_frames;
    indices = arange(n) · total // n. Without a target fps (or a native fps), every frame is kept
    (then thinned uniformly to max_video_frames).
    """
    if total_frames < 1:
        raise ValueError("the video has no frames")
    if config.video_fps is None or not native_fps:
        count = total_frames
    else:
        count = max(1, int(total_frames / native_fps * config.video_fps))
    count = min(count, total_frames, config.max_video_frames)
    return np.arange(count, dtype=np.int64) * total_frames // count


def process_video(
    frames: np.ndarray, frame_indices: np.ndarray, native_fps: float | None, config: ProcessorConfig
) -> list[VisionItem]:
    """uint8 sampled frames [F, H, W, 3] -> one VisionItem per chunk of <= 4 temporal patches.

    frame_indices: the F source-frame indices (for timestamps = index / native_fps, taken at the
    first frame of each temporal patch, as HF's processor does).
    """
    num_frames, height, width = frames.shape[:3]
    new_height, new_width = smart_resize(
        height,
        width,
        factor=config.factor,
        min_pixels=config.video_min_pixels,
        max_pixels=config.video_max_pixels,
    )
    pixels = normalize(resize_bicubic_uint8(frames, new_height, new_width))
    T = config.temporal_patch_size
    if pad := -num_frames % T:
        pixels = np.concatenate([pixels, np.repeat(pixels[-1:], pad, axis=0)])
    grid_t = pixels.shape[0] // T
    stamps = [""] * grid_t
    if config.timestamps and native_fps:
        stamps = [
            timestamp_text(frame_indices[min(f * T, len(frame_indices) - 1)] / native_fps)
            for f in range(grid_t)
        ]
    items = []
    for start in range(0, grid_t, config.chunk_temporal_patches):
        stop = min(start + config.chunk_temporal_patches, grid_t)
        patches, grid = patchify(pixels[start * T : stop * T], config)
        items.append(VisionItem(patches, grid, tuple(s for s in stamps[start:stop] if s)))
    return items


def timestamp_text(seconds: float) -> str:
    return f"]<]{seconds:.1f} seconds[>["


def num_image_tokens(height: int, width: int, config: ProcessorConfig) -> int:
    """Placeholder tokens of an image of height×width pixels (without the start/end brackets)."""
    new_height, new_width = smart_resize(
        height,
        width,
        factor=config.factor,
        min_pixels=config.image_min_pixels,
        max_pixels=config.image_max_pixels,
    )
    return new_height * new_width // config.factor**2


def num_video_tokens(num_frames: int, height: int, width: int, config: ProcessorConfig) -> int:
    """Placeholder tokens of a video of `num_frames` sampled frames (brackets and stamps aside)."""
    new_height, new_width = smart_resize(
        height,
        width,
        factor=config.factor,
        min_pixels=config.video_min_pixels,
        max_pixels=config.video_max_pixels,
    )
    grid_t = -(-num_frames // config.temporal_patch_size)
    return grid_t * new_height * new_width // config.factor**2
