"""One synthetic CLEVR-style sample: a scene of flat shapes, its picture, and a question about it.

Everything here is pure: a scene and a question are functions of the `random.Random` passed in,
so a caller that seeds one generator per sample gets the same sample on every run and machine.
Writing samples to shards lives in `vlmrun.datasets.clevr`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from PIL import Image, ImageDraw

SHAPES: tuple[str, ...] = ("circle", "square", "triangle")
#: Saturated, well-separated colors, so the color at an object's center survives JPEG.
COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "yellow": (235, 215, 40),
    "purple": (140, 50, 180),
    "cyan": (40, 205, 215),
    "gray": (120, 120, 120),
    "brown": (135, 85, 35),
}
SIZES: tuple[str, ...] = ("small", "large")
BACKGROUND: tuple[int, int, int] = (238, 238, 232)

TEMPLATES: tuple[str, ...] = (
    "count_all",
    "count_color",
    "count_shape",
    "count_color_shape",
    "exist_color_shape",
)
_PLACEMENT_TRIES = 200


@dataclass(frozen=True)
class SceneObject:
    """One shape; `bbox` is (x0, y0, x1, y1) in pixels with x1, y1 exclusive."""

    shape: str
    color: str
    size: str
    bbox: tuple[int, int, int, int]

    def to_json(self) -> dict:
        return {
            "shape": self.shape,
            "color": self.color,
            "size": self.size,
            "bbox": list(self.bbox),
        }


@dataclass(frozen=True)
class Question:
    template: str
    text: str
    answer: str


def max_objects(image_size: int) -> int:
    """The most objects a scene of this size holds: 6 at 112 px, 10 from 200 px up."""
    return max(6, min(10, image_size // 20))


def object_side(size: str, image_size: int) -> int:
    """Side of an object's square bounding box in pixels."""
    fraction = 0.12 if size == "small" else 0.2
    return max(6, round(image_size * fraction))


def placement_margin(image_size: int) -> int:
    """Minimum gap in pixels between two bounding boxes, and between a box and the border."""
    return max(2, image_size // 40)


def sample_scene(rng: random.Random, image_size: int) -> list[SceneObject]:
    """Draw 1..max_objects objects whose bounding boxes (plus margin) never overlap.

    Placement is rejection sampling; an object that finds no free spot is dropped, so a crowded
    scene may hold fewer objects than drawn (never zero: the first object always fits).
    """
    wanted = rng.randint(1, max_objects(image_size))
    margin = placement_margin(image_size)
    objects: list[SceneObject] = []
    for _ in range(wanted):
        shape, color, size = rng.choice(SHAPES), rng.choice(list(COLORS)), rng.choice(SIZES)
        bbox = _place(rng, object_side(size, image_size), image_size, margin, objects)
        if bbox is not None:
            objects.append(SceneObject(shape, color, size, bbox))
    return objects


def _place(
    rng: random.Random, side: int, image_size: int, margin: int, placed: list[SceneObject]
) -> tuple[int, int, int, int] | None:
    for _ in range(_PLACEMENT_TRIES):
        x0 = rng.randint(margin, image_size - margin - side)
        y0 = rng.randint(margin, image_size - margin - side)
        bbox = (x0, y0, x0 + side, y0 + side)
        if all(not boxes_touch(bbox, other.bbox, margin) for other in placed):
            return bbox
    return None


def boxes_touch(a: tuple[int, int, int, int], b: tuple[int, int, int, int], margin: int) -> bool:
    """True when the boxes overlap or come closer than `margin` pixels."""
    return not (a[2] + margin <= b[0] or b[2] + margin <= a[0] or a[3] + margin <= b[1] or b[3] + margin <= a[1])


def draw_scene(objects: list[SceneObject], image_size: int) -> Image.Image:
    """Render the objects as flat shapes on a plain background (RGB, image_size x image_size)."""
    image = Image.new("RGB", (image_size, image_size), BACKGROUND)
    draw = ImageDraw.Draw(image)
    for obj in objects:
        x0, y0, x1, y1 = obj.bbox
        fill = COLORS[obj.color]
        # PIL's box corners are inclusive, ours are exclusive.
        if obj.shape == "circle":
            draw.ellipse((x0, y0, x1 - 1, y1 - 1), fill=fill)
        elif obj.shape == "square":
            draw.rectangle((x0, y0, x1 - 1, y1 - 1), fill=fill)
        else:
            draw.polygon([((x0 + x1 - 1) / 2, y0), (x0, y1 - 1), (x1 - 1, y1 - 1)], fill=fill)
    return image


def sample_question(rng: random.Random, objects: list[SceneObject]) -> Question:
    """Pick a template uniformly, then its attributes, and answer it from the scene.

    Attributes are chosen answer-first: among the distinct answers the scene allows (e.g. some
    color appears twice, some once, some never), one is picked uniformly, then an attribute with
    that answer. This keeps "0" and "1" from swamping count answers. Existence questions are
    "yes" with probability 1/2 exactly.
    """
    template = rng.choice(TEMPLATES)
    if template == "count_all":
        return Question(template, "How many objects are there?", str(len(objects)))
    if template == "count_color":
        color, count = _pick_by_answer(rng, {c: sum(o.color == c for o in objects) for c in COLORS})
        return Question(template, f"How many {color} objects are there?", str(count))
    if template == "count_shape":
        shape, count = _pick_by_answer(rng, {s: sum(o.shape == s for o in objects) for s in SHAPES})
        return Question(template, f"How many {shape}s are there?", str(count))
    pair_counts = {(c, s): sum(_pair(o) == (c, s) for o in objects) for c in COLORS for s in SHAPES}
    if template == "count_color_shape":
        (color, shape), count = _pick_by_answer(rng, pair_counts)
        return Question(template, f"How many {color} {shape}s are there?", str(count))
    answer = "yes" if rng.random() < 0.5 else "no"
    color, shape = rng.choice([pair for pair, n in pair_counts.items() if (n > 0) == (answer == "yes")])
    return Question("exist_color_shape", f"Is there a {color} {shape}?", answer)


def _pick_by_answer(rng: random.Random, counts: dict) -> tuple:
    """(attribute, count): a count drawn uniformly from the distinct counts, then an attribute."""
    count = rng.choice(sorted(set(counts.values())))
    return rng.choice([attr for attr, n in counts.items() if n == count]), count


def _pair(obj: SceneObject) -> tuple[str, str]:
    return obj.color, obj.shape
