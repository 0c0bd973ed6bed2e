"""Images beside text for a Hugging Face model of text and images, made from its vision config.

The images take the layout the model's forward asks for:
- `pixel_values` (batch, channels, size, size), the size being the vision config's image_size or,
  where it has none, a few patches (patch_size) of it; with `image_sizes` beside them where the
  forward takes them (LLaVA-NeXT, Pixtral), and one image per sample (batch, 1, channels, size,
  size) where it takes a `pixel_attention_mask` (Idefics3);
- flattened patches with `image_grid_thw` (Qwen2-VL and the models built like it): one image per
  sample of (1, h, w) patches, h and w twice the spatial merge, each patch of channels x
  temporal_patch_size x patch_size^2 values; then each patch as an image of its own (channels,
  patch_size, patch_size), then each merged token's block of pixels, channels last, on a grid of
  tokens; with `image_merge_sizes` and `images_per_sample` where the forward takes them;
- flattened patches with `spatial_shapes` and a `pixel_attention_mask` (SigLIP 2's NaFlex layout,
  LFM2-VL): one image per sample of 4 x 4 patches of channels x patch_size^2 values;
- after the layouts above, those of forwards that need more beside the images: a mask of real
  tiles (`pixel_attention_mask` of (batch, tiles)), images of as many patches as a projector of
  fixed query counts takes (`*patch_to_query_dict`), tiles with their aspect ratio
  (`aspect_ratio_ids`, `aspect_ratio_mask`), patches pooled into tokens by index
  (`image_token_pooling`, `image_grids`), and a second view of each image for a tower of its own
  (`<name>_pixel_values` beside a `<name>_vision_config`).

A model that puts its image features in place of image tokens in `input_ids` checks that their
counts agree (`get_placeholder_mask`). The count is found by running the forward on meta copies
up to that check (KnownValues answers the value reads on the way), and the ids are made again
with that many image tokens (config.image_token_id / image_token_index), each sample's between
the vision start and end tokens where the config has them.
"""

import inspect
import math
from typing import Dict, List, Optional

import torch
from torch import nn

from ..conventions import huggingface as hf
from .meta_shadow import meta_shadow
from .module_inputs import Stop, as_dtype, float_dtype, forward_arguments, forward_on_meta


def first_of(config, *names):
    """The first of `names` the config holds (not None), or None."""
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return None


def image_token(config) -> Optional[int]:
    values = (first_of(holder, *hf.IMAGE_TOKEN) for holder in (config, getattr(config, "text_config", None)))
    return next((v for v in values if isinstance(v, int)), None)


def _positive(vision, names, default):
    """The first of `names` the vision config holds (of a list, its first entry) if a positive
    integer, else `default`."""
    value = first_of(vision, *names)
    if isinstance(value, (list, tuple)):
        value = value[0]
    return value if isinstance(value, int) and value > 0 else default


def _patch(vision) -> int:
    return _positive(vision, hf.PATCH_SIZE, 16)


def _image_size(vision) -> int:
    # No image size: a few patches, as many as the spatial merge takes together.
    return _positive(vision, (hf.IMAGE_SIZE,), None) or 4 * _patch(vision) * _positive(vision, hf.SPATIAL_MERGE, 1)


def _channels(vision) -> int:
    value = first_of(vision, *hf.IMAGE_CHANNELS)
    return value if isinstance(value, int) and value > 0 else 3


def _any_resolution(config, size: int):
    """(crops, image size) for an any-resolution model (LLaVA-NeXT): an image of its smallest
    grid pinpoint, cut into crops of `size` and a crop of the whole."""
    pinpoints = getattr(config, hf.IMAGE_GRID_PINPOINTS, None)
    if not isinstance(pinpoints, list) or not pinpoints:
        return 1, (size, size)
    height, width = min(pinpoints, key=lambda p: p[0] * p[1])
    return hf.any_resolution_crops((height, width), pinpoints, size), (height, width)


def image_layouts(model: nn.Module, config, batch: int) -> List[Dict[str, torch.Tensor]]:
    """The layouts of image inputs the model's forward may take, the likeliest first."""
    vision = getattr(config, "vision_config", None) or config
    accepted = set(inspect.signature(model.forward).parameters)
    channels = _channels(vision)
    if "image_grid_thw" in accepted:
        return _grid_layouts(vision, accepted, channels, batch)
    if "spatial_shapes" in accepted:
        # Patches flattened, with each image's grid of patches and a mask of the real ones
        # (SigLIP 2's NaFlex layout, LFM2-VL): one image per sample of side x side patches.
        patch, side = _patch(vision), 4
        return [{"pixel_values": torch.zeros(batch, side * side, channels * patch * patch),
                 "spatial_shapes": torch.tensor([[side, side]] * batch),
                 "pixel_attention_mask": torch.ones(batch, side * side, dtype=torch.bool)}]
    size = _image_size(vision)
    layouts = [{"pixel_values": torch.zeros(batch, channels, size, size)},
               {"pixel_values": torch.zeros(batch, 1, channels, size, size)}]
    if "image_sizes" in accepted:
        crops, whole = _any_resolution(config, size)
        layouts = [{"pixel_values": torch.zeros(batch, crops, channels, size, size),
                    "image_sizes": torch.tensor([list(whole)] * batch)},
                   {**layouts[0], "image_sizes": torch.tensor([[size, size]] * batch)}] + layouts
    if "pixel_attention_mask" in accepted:
        layouts.reverse()  # Idefics3: (batch, images, channels, height, width)
        # A mask of the real tiles among each sample's (Granite-Docling), not of pixels.
        layouts.append({"pixel_values": torch.zeros(batch, 1, channels, size, size),
                        "pixel_attention_mask": torch.ones(batch, 1, dtype=torch.bool)})
    queried = _projector_image_size(config, vision)
    if queried is not None:
        layouts.append({"pixel_values": torch.zeros(batch, channels, queried, queried)})
    if "aspect_ratio_ids" in accepted:
        layouts.append(_tiles(vision, channels, size, batch))
    if "image_token_pooling" in accepted:
        layouts.append(_pooled_patches(vision, channels, batch))
    # Images that each need a second view of themselves for another tower (DeepSeek-VL's high
    # resolution one), at that tower's own size.
    companions = _companion_images(config, accepted, batch)
    if companions:
        layouts += [{**layout, **companions} for layout in layouts]
    return layouts


def _grid_layouts(vision, accepted, channels: int, batch: int) -> List[Dict[str, torch.Tensor]]:
    """One image per sample of side x side patches, side twice the spatial merge, its patches in
    each of the layouts a patch embedding takes; with the merge of each image where the forward
    takes it."""
    patch, merge = _patch(vision), _positive(vision, hf.SPATIAL_MERGE, 1)
    temporal = first_of(vision, *hf.TEMPORAL_PATCH_SIZE) or 1
    side = 2 * merge
    patches = batch * side * side
    grid = torch.tensor([[1, side, side]] * batch)
    depth = [temporal] if temporal > 1 else []
    layouts = [
        # Qwen2-VL: each patch flattened, its channels, frames and pixels in one row.
        {"pixel_values": torch.zeros(patches, channels * temporal * patch * patch), "image_grid_thw": grid},
        # Each patch an image of its own, for a patch embedding that convolves it (Kimi-K2.5).
        {"pixel_values": torch.zeros(patches, channels, *depth, patch, patch), "image_grid_thw": grid},
        # Each merged token's block of merge x merge patches, channels last, the grid counting
        # tokens (Inkling2).
        {"pixel_values": torch.zeros(batch * 4, merge * patch, merge * patch, channels),
         "image_grid_thw": torch.tensor([[1, 2, 2]] * batch)}]
    extra = {}
    if "image_merge_sizes" in accepted:
        extra["image_merge_sizes"] = torch.tensor([merge] * batch)
    if "images_per_sample" in accepted:
        # A model that makes images (GLM-Image) reads each sample's grids as its source images
        # followed by the grid of the image it is to make: the same grid again, after each image.
        extra["images_per_sample"] = torch.tensor([2] * batch)
        layouts = [{**layout, "image_grid_thw": layout["image_grid_thw"].repeat_interleave(2, dim=0)}
                   for layout in layouts]
    return [{**layout, **extra} for layout in layouts]


def _projector_image_size(config, vision) -> Optional[int]:
    """The side of an image whose patches a projector of fixed query counts takes (Aria: queries
    by number of patches), or None where the config names no such counts."""
    counts = next((value for name, value in vars(config).items()
                   if name.endswith("patch_to_query_dict") and isinstance(value, dict) and value), None)
    if counts is None:
        return None
    patches = min(int(k) for k in counts)
    per_side = math.isqrt(patches)
    return per_side * _patch(vision) if per_side * per_side == patches else None


def _tiles(vision, channels: int, size: int, batch: int) -> Dict[str, torch.Tensor]:
    """One image per sample cut into the vision config's max_num_tiles tiles (Mllama), of its
    first supported aspect ratio (ids count from one, 0 being padding), the tiles it spans real."""
    tiles = first_of(vision, "max_num_tiles") or 1
    ratios = first_of(vision, "supported_aspect_ratios") or [[1, 1]]
    real = min(tiles, math.prod(ratios[0]))
    mask = torch.zeros(batch, 1, tiles, dtype=torch.long)
    mask[..., :real] = 1
    return {"pixel_values": torch.zeros(batch, 1, tiles, channels, size, size),
            "aspect_ratio_ids": torch.ones(batch, 1, dtype=torch.long), "aspect_ratio_mask": mask}


def _pooled_patches(vision, channels: int, batch: int) -> Dict[str, torch.Tensor]:
    """One crop per sample of flattened patches, as many as the tower's position table, pooled
    into image tokens by the indices of the patches each token pools (Molmo2): 4 tokens a crop,
    each of 4 patches, and each image's grids of tokens (its whole and its crops: 2 x 2 and none)."""
    patch = _patch(vision)
    positions = first_of(vision, "num_position_embeddings")
    if not isinstance(positions, int):
        positions = (_image_size(vision) // patch) ** 2
    tokens, pooled = 4, 4
    pooling = torch.stack([image * positions + torch.arange(tokens * pooled).view(tokens, pooled)
                           for image in range(batch)]).view(-1, pooled)
    return {"pixel_values": torch.zeros(batch, positions, channels * patch * patch),
            "image_token_pooling": pooling, "image_grids": torch.tensor([[2, 2, 0, 0]] * batch)}


def _companion_images(config, accepted, batch: int) -> Dict[str, torch.Tensor]:
    """Images for each `<name>_pixel_values` the forward takes whose config has a
    `<name>_vision_config`, at that config's image size and channels."""
    images = {}
    for argument in sorted(accepted):
        prefix = argument[:-len("pixel_values")]
        tower = getattr(config, prefix + "vision_config", None) if argument.endswith("_pixel_values") else None
        if tower is not None:
            size = _image_size(tower)
            images[argument] = torch.zeros(batch, _channels(tower), size, size)
    return images


def _image_features(bound: dict):
    """The image features a placeholder check was called with, or None."""
    return next((bound[k] for k in hf.IMAGE_FEATURES if bound.get(k) is not None), None)


def count_at_check(model: nn.Module, kwargs: dict, checks=lambda module: hf.PLACEHOLDER_CHECKS,
                   features_of=_image_features, on_meta: bool = True) -> Optional[int]:
    """The number of tokens the features fill at the model's placeholder check (for images unless
    told otherwise: `checks(module)` names a module's check methods, `features_of(arguments)`
    picks the features from a check's bound arguments), or None if the forward ends without one.
    Raises what the forward raises before it. The forward runs on a meta copy of the model: one
    that changes its own state as it runs (SeamlessM4T's relative positions extend a buffer)
    must reach the planner's trace as it was before, as it reaches the dry run. With
    on_meta=False it runs on the model and kwargs themselves (a tiny model runs in milliseconds,
    and the count is then the one its own forward sees)."""
    if on_meta:
        model = meta_shadow(model, always_copy=True)
    patched = []
    for module in model.modules():
        for name in checks(module):
            check = getattr(module, name, None)
            if check is None or not callable(check) or name in vars(module):
                continue
            signature = inspect.signature(check)

            def counting(*args, check=check, signature=signature, **kw):
                bound = signature.bind_partial(*args, **kw).arguments
                features = features_of(bound)
                embeds = bound.get("inputs_embeds")
                if features is None or not isinstance(embeds, torch.Tensor):
                    return check(*args, **kw)
                tensors = features if isinstance(features, (list, tuple)) else [features]
                raise Stop(sum(t.numel() for t in tensors) // embeds.shape[-1])

            setattr(module, name, counting)
            patched.append((module, name))
    try:
        if on_meta:
            forward_on_meta(model, (), kwargs)
        else:
            with torch.no_grad():
                model(**kwargs)
    except Stop as counted:  # the number of tokens the features fill
        return counted.found
    finally:
        for module, name in patched:
            delattr(module, name)
    return None


def ids_with_tokens(ids: torch.Tensor, token: int, count: int, start: Optional[int] = None,
                    end: Optional[int] = None) -> torch.Tensor:
    """`ids` with `count` tokens `token` after each sample's first id, shared out over the samples,
    each sample's between `start` and `end` where given. Rows of uneven length end in their own
    last id repeated (no padding token, no mask)."""
    rows = []
    for i in range(ids.shape[0]):
        mine = count // ids.shape[0] + (1 if i < count % ids.shape[0] else 0)
        block = ([start] if isinstance(start, int) else []) + [token] * mine + ([end] if isinstance(end, int) else [])
        rows.append(ids[i, :1].tolist() + block + ids[i, 1:].tolist())
    length = max(len(r) for r in rows)
    return torch.tensor([r + [r[-1]] * (length - len(r)) for r in rows], dtype=ids.dtype)


def with_ids(inputs: Dict[str, torch.Tensor], ids: torch.Tensor) -> Dict[str, torch.Tensor]:
    """`inputs` with input_ids `ids`, and the attention mask and token types given made for them."""
    inputs = {**inputs, "input_ids": ids}
    for name, value in (("attention_mask", torch.ones_like(ids)), ("token_type_ids", torch.zeros_like(ids))):
        if name in inputs:
            inputs[name] = value
    return inputs


def shapes(inputs: Dict[str, torch.Tensor]) -> str:
    return ", ".join(f"{k} {tuple(v.shape)}" for k, v in inputs.items())


def with_images(model: nn.Module, config, kwargs: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """kwargs (input_ids among them) with the model's image inputs, and image tokens in the ids
    where its forward places the image features by them. The layouts of image_layouts() are
    tried in turn by running the forward on meta copies up to the placeholder check."""
    dtype = float_dtype(model)
    token = image_token(config)
    failures = []
    for images in image_layouts(model, config, kwargs["input_ids"].shape[0]):
        images = as_dtype(images, dtype)
        tried = {**kwargs, **images}
        if token is None:
            return tried  # a dual encoder (CLIP): its images need no tokens
        try:
            count = count_at_check(model, tried)
        except Exception as error:  # noqa: BLE001 - the model's own error, told in ours
            failures.append(f"{shapes(images)}: {type(error).__name__}: {str(error)[:300]}")
            continue
        if count is None:
            return tried
        start, end = first_of(config, *hf.VISION_START_TOKEN), first_of(config, *hf.VISION_END_TOKEN)
        tried = with_ids(tried, ids_with_tokens(kwargs["input_ids"], token, count, start, end))
        if "mm_token_type_ids" in forward_arguments(model):
            tried["mm_token_type_ids"] = (tried["input_ids"] == token).long()  # 1 where an image token is
        return tried
    raise RuntimeError("plan: the forward failed with each layout of images autoshard made ("
                       + "; ".join(failures) + ")")
