"""The vision side of a vision-language artifact at run time: numpy, Pillow and onnxruntime only.

- ``VisionEncoder``: one onnxruntime session over the artifact's ``vision`` graph
  (``pixel_values [images, 3, H, W]`` -> ``image_embeddings [image_rows, hidden]``, rows image by
  image, ``placeholder.num_tokens`` rows per image) and an ``EmbeddingCache`` in front of it, so a
  repeated image is not encoded again. ``load`` turns a request's image (path, bytes, PIL image or
  uint8 array) into an ``ImageInput`` (decoded RGB image, content hash, placeholder count) with
  every refusal up front; ``encode`` returns one ``[tokens, hidden]`` array per image.
- ``EmbeddingCache``: LRU keyed by ``imaging.content_hash`` (one engine serves one artifact, so
  the pixels are the whole key), bounded in bytes, counting hits and misses.
- ``expand_placeholders``: the processor's prompt expansion on token ids: every image token
  becomes ``num_tokens`` copies of itself, and the positions of those copies are where the
  image's embedding rows go (the decoder seam, ``graphkiln.models.decoder``).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from graphkiln.errors import GraphkilnError
from graphkiln.manifest import GraphSpec, VisionSpec

DEFAULT_CACHE_BYTES = 256 << 20  # embedding cache bound: 256 MiB
MAX_IMAGES_PER_RUN = 16  # images encoded per vision-graph run (bounds the activations' memory)


@dataclass(frozen=True, eq=False)
class ImageInput:
    """One request image, decoded and checked: ``image`` (RGB PIL), ``key`` (its content hash,
    the cache key) and ``tokens`` (how many placeholder tokens it expands to in the prompt);
    ``grid``: its patch grid (t, h, w) where the preprocessing has one (qwen2_vl), else None."""

    image: Any
    key: str
    tokens: int
    grid: tuple[int, int, int] | None = None


class EmbeddingCache:
    """Least-recently-used image embeddings, keyed by content hash, at most ``max_bytes`` of them.

    An embedding larger than the whole bound is not kept; ``max_bytes`` 0 keeps nothing.
    ``hits``/``misses`` count ``get`` calls (a test checks a repeated image is a hit)."""

    def __init__(self, max_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        if not (isinstance(max_bytes, int) and not isinstance(max_bytes, bool) and max_bytes >= 0):
            raise GraphkilnError(f"the vision cache size must be an integer number of bytes >= 0, got {max_bytes!r}: "
                                 "pass e.g. vision_cache_bytes=256 << 20 (0 disables the cache)")
        self.max_bytes = max_bytes
        self.bytes = 0
        self.hits = self.misses = 0
        self._entries: OrderedDict[str, np.ndarray] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def get(self, key: str) -> np.ndarray | None:
        rows = self._entries.get(key)
        if rows is None:
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return rows

    def put(self, key: str, rows: np.ndarray) -> None:
        if key in self._entries:
            self.bytes -= self._entries.pop(key).nbytes
        if rows.nbytes > self.max_bytes:
            return
        rows.setflags(write=False)  # handed out to every request that shows this image
        self._entries[key] = rows
        self.bytes += rows.nbytes
        while self.bytes > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            self.bytes -= old.nbytes

    def clear(self) -> None:
        self._entries.clear()
        self.bytes = 0


class VisionEncoder:
    """Runs the artifact's vision graph on onnxruntime (CPU), behind an ``EmbeddingCache``.

    ``runs`` counts vision-graph runs and ``images_encoded`` the images they encoded: a request
    whose images are all cached leaves both unchanged."""

    def __init__(self, artifact_dir: Path, spec: VisionSpec, graph: GraphSpec, threads: int | None = None,
                 cache_bytes: int = DEFAULT_CACHE_BYTES, run_graph: Callable[[dict], np.ndarray] | None = None) -> None:
        """``run_graph``: feeds -> the graph's image_embeddings, when the vision graph runs
        elsewhere (a staged artifact's first-stage Ray actor, ``runtime.backends.distributed``); None opens
        the graph here. Preprocessing and the cache stay in this process either way."""
        from graphkiln.runtime.backends.ort_cpu import cpu_session, numpy_dtype

        self.spec, self.graph = spec, graph
        self.cache = EmbeddingCache(cache_bytes)
        self.runs = self.images_encoded = 0
        names = {t.role: t.name for t in graph.inputs}
        out = next(t for t in graph.outputs if t.role == "image_embeddings")
        self._pixel_values, self._grid, self._output = names["pixel_values"], names.get("image_grid_thw"), out.name
        self.hidden = out.shape[-1] if isinstance(out.shape[-1], int) else None
        self.dtype = numpy_dtype(out.dtype)
        if run_graph is None:
            session = cpu_session(artifact_dir, graph, threads)
            run_graph = lambda feeds: session.run([self._output], feeds)[0]  # noqa: E731
        self._run_graph = run_graph
        self._groups, self._window = _group_inputs(graph, spec)

    # -- one request image ---------------------------------------------------------------

    def load(self, source: Any, where: str = "image") -> ImageInput:
        """Decode and check one image as the request gives it (``imaging.load_image``, at most the
        artifact's ``max_image_pixels``); refusals are one-line ``ImageError``s prefixed by ``where``."""
        from graphkiln.imaging import ImageError, content_hash, load_image, plan

        try:
            image = load_image(source, self.spec.max_image_pixels)
            width, height = image.size
            size, grid = plan(self.spec.preprocessing, width, height)
            tokens = self.spec.placeholder.num_tokens(size, grid)
        except ImageError as exc:
            raise ImageError(f"{where}: {exc}") from None
        except ValueError as exc:  # the artifact's rule cannot count this image
            raise ImageError(f"{where}: {exc}") from None
        if tokens < 1:
            raise ImageError(f"{where} ({width}x{height}) expands to no placeholder token: pass a larger image")
        return ImageInput(image, content_hash(image), tokens, grid)

    # -- embeddings -----------------------------------------------------------------------

    def encode(self, images: Sequence[Any]) -> list[np.ndarray]:
        """One ``[tokens, hidden]`` array per image (PIL images or ``ImageInput``s), in order:
        cached ones from the cache, the others from the vision graph (each distinct image once,
        up to ``MAX_IMAGES_PER_RUN`` per run), then cached. Arrays are read-only and shared."""
        items = [im if isinstance(im, ImageInput) else self.load(im, f"image {i}") for i, im in enumerate(images)]
        found: dict[str, np.ndarray] = {}
        todo: list[ImageInput] = []
        for item in items:
            if item.key in found or any(t.key == item.key for t in todo):
                continue
            rows = self.cache.get(item.key)
            if rows is None:
                todo.append(item)
            else:
                found[item.key] = rows
        for start in range(0, len(todo), MAX_IMAGES_PER_RUN):
            chunk = todo[start:start + MAX_IMAGES_PER_RUN]
            for item, rows in zip(chunk, self._run(chunk)):
                found[item.key] = rows
                self.cache.put(item.key, rows)
        return [found[item.key] for item in items]

    def _run(self, items: list[ImageInput]) -> list[np.ndarray]:
        from graphkiln.imaging import preprocess

        pre = preprocess([item.image for item in items], self.spec.preprocessing)
        feeds = {self._pixel_values: pre.pixel_values}
        if self._grid is not None:
            feeds[self._grid] = pre.image_grid_thw
        if self._groups:  # a windowed tower's patch grid and attention groups
            from graphkiln.runtime.backends.vision_groups import patch_groups

            groups = patch_groups(pre.grids, self.spec.preprocessing.merge_size, self._window)
            feeds.update({name: groups[role] for role, name in self._groups.items()})
        counts = [item.tokens for item in items]
        try:
            rows = self._run_graph(feeds)
        except GraphkilnError:
            raise
        except Exception as exc:
            raise GraphkilnError(f"the vision graph failed on {len(items)} image(s) "
                                 f"({(str(exc).splitlines() or [type(exc).__name__])[0][:200]}): re-export the "
                                 "artifact") from None
        if rows.ndim != 2 or rows.shape[0] != sum(counts) or (self.hidden is not None and rows.shape[1] != self.hidden):
            raise GraphkilnError(f"the vision graph returned {list(rows.shape)} for {len(items)} image(s), expected "
                                 f"[{sum(counts)}, {self.hidden or 'hidden'}] ({'+'.join(map(str, counts))} placeholder "
                                 "rows): the artifact's vision spec and graph disagree; re-export it")
        self.runs += 1
        self.images_encoded += len(items)
        bounds = np.cumsum(counts)[:-1]
        return [np.array(part) for part in np.split(rows, bounds)]  # own copies: the session's buffer is not kept


def _group_inputs(graph: GraphSpec, spec: VisionSpec) -> tuple[dict[str, str], int]:
    """The vision graph's ``runtime.backends.vision_groups`` inputs (role -> input name) and the window (in
    merge units) its static ``window_groups`` width implies; ({}, 0) for a graph without them."""
    from graphkiln.runtime.backends.vision_groups import GROUP_ROLES, window_from_area

    names = {t.role: t.name for t in graph.inputs if t.role in GROUP_ROLES}
    if not names:
        return {}, 0
    merge = spec.preprocessing.merge_size
    windows = next((t for t in graph.inputs if t.role == "window_groups"), None)
    if set(names) != set(GROUP_ROLES) or merge is None or windows is None:
        raise GraphkilnError(f"the vision graph takes {', '.join(sorted(names))} but not all of "
                             f"{', '.join(GROUP_ROLES)} with qwen2_vl preprocessing: re-export the artifact")
    try:
        window = window_from_area(windows.shape[1], merge)
    except ValueError as exc:
        raise GraphkilnError(f"the vision graph's window_groups: {exc}: re-export the artifact") from None
    return names, window


def expand_placeholders(ids: Sequence[int], image_token_id: int, counts: Sequence[int], *, prompt: int = 0,
                        token_text: str = "<image>", rule: Any = None) -> tuple[list[int], np.ndarray]:
    """Expand each ``image_token_id`` in ``ids`` (k-th occurrence, k-th image) as the model's
    processor does; return the expanded ids and the position in them of every token that takes an
    image row, in order (int64 ``[sum(counts)]``: where the images' embedding rows go).

    Without a ``rule`` (``imaging.PlaceholderRule``), or one with no prefix, suffix or row token
    (LLaVA, Qwen), the placeholder becomes ``counts[k]`` copies of itself. Otherwise it becomes
    ``rule.prefix_ids + [rule.row_token_id] * counts[k] + rule.suffix_ids`` (Gemma3), and a
    prompt that already holds a row token (which only the processor places) is refused.

    On token ids this equals the processor's text-level expansion wherever the prefix and suffix
    tokenize on their own, which special tokens do; Gemma3's "\n\n" could merge with newlines the
    prompt puts right beside ``<start_of_image>`` when text is tokenized after expanding.

    A prompt whose placeholder count is not its image count is refused in one line naming
    ``prompt`` and ``token_text``."""
    check_placeholder_count(ids, image_token_id, len(counts), prompt=prompt, token_text=token_text)
    row = image_token_id
    prefix: tuple[int, ...] = ()
    suffix: tuple[int, ...] = ()
    if rule is not None:
        prefix, suffix = tuple(rule.prefix_ids), tuple(rule.suffix_ids)
        if rule.row_token_id is not None and rule.row_token_id != image_token_id:
            row = rule.row_token_id
            if any(t == row for t in ids):
                raise GraphkilnError(f"prompt {prompt} holds image row token {row}, which only the expansion of "
                                     f"{token_text} places: write {token_text} where each image goes instead")
    at = [i for i, t in enumerate(ids) if t == image_token_id]
    out: list[int] = []
    positions: list[np.ndarray] = []
    prev = 0
    for i, n in zip(at, counts):
        out.extend(ids[prev:i])
        out.extend(prefix)
        positions.append(np.arange(len(out), len(out) + n, dtype=np.int64))
        out.extend([row] * n)
        out.extend(suffix)
        prev = i + 1
    out.extend(ids[prev:])
    return out, (np.concatenate(positions) if positions else np.zeros(0, np.int64))


def check_placeholder_count(ids: Sequence[int], image_token_id: int, images: int, *, prompt: int = 0,
                            token_text: str = "<image>") -> None:
    """One-line GraphkilnError unless ``ids`` hold exactly ``images`` image tokens."""
    found = sum(1 for t in ids if t == image_token_id)
    if found != images:
        raise GraphkilnError(
            f"prompt {prompt} has {_count(found, token_text + ' placeholder')} but {_count(images, 'image')}: "
            f"put one {token_text} in the prompt where each image goes, in order, one per image")


def _count(n: int, noun: str) -> str:
    if n == 0:
        return f"no {noun}"
    return f"{n} {noun}" + ("" if n == 1 else "s")
