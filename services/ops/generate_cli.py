"""``darkroom generate`` and ``darkroom upscale``: a job through a running gateway,
its progress shown, its image or video written to a file. Text to image by
default; ``--video`` for a video, ``--image`` (with ``--mask``) for an edit; the
output file's extension picks the format. Without ``--model``, the gateway's
default model of the capability asked for."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

# The format a file's extension asks for, for an image and for a video.
IMAGE_SUFFIXES = {".png": "OUTPUT_FORMAT_PNG", ".jpg": "OUTPUT_FORMAT_JPEG", ".jpeg": "OUTPUT_FORMAT_JPEG"}
IMAGE_SUFFIXES[".webp"] = "OUTPUT_FORMAT_WEBP"
VIDEO_SUFFIXES = {".mp4": "OUTPUT_FORMAT_MP4", ".webp": "OUTPUT_FORMAT_WEBP"}


class BadArgument(Exception):
    """An option the command cannot use as given: a file it cannot read, an output
    it cannot write in that format."""


def add_options(p: argparse.ArgumentParser, *, output: str = "darkroom.png") -> None:
    p.add_argument("-o", "--output", default=output, help="where to write it; .png, .jpg or .webp (.mp4 for a video)")
    p.add_argument("--model", help="default: the gateway's default model of the kind of work asked for")
    p.add_argument("--negative-prompt", default="")
    p.add_argument("--width", type=int)
    p.add_argument("--height", type=int)
    p.add_argument("--steps", type=int)
    p.add_argument("--seed", type=int)
    p.add_argument("--guidance", type=float)
    p.add_argument("--api-key", default=os.environ.get("DARKROOM_API_KEY", ""))


def add_media_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--video", action="store_true", help="make a video (write it to .mp4 or .webp)")
    p.add_argument("--frames", type=int, help="a video's frames (the model's rule, e.g. 4k+1)")
    p.add_argument("--fps", type=float, help="a video's frames per second")
    p.add_argument("--image", help="an input image to edit (PNG, JPEG or WebP)")
    p.add_argument("--mask", help="inpainting: white where to paint, black where to keep the input")
    p.add_argument("--strength", type=float, help="an edit's share of repainting, (0, 1]")
    p.add_argument(
        "--lora",
        action="append",
        default=[],
        metavar="NAME[:VERSION][:SCALE]",
        help="a LoRA adapter of the model store, with its scale (default 1); again for another",
    )


def capability_of(args: argparse.Namespace) -> str:
    if getattr(args, "upscale", False):
        return "upscale"
    return "video" if getattr(args, "video", False) else "image"


def build_request(prompt: str, args: argparse.Namespace):
    """The SubmitJobRequest the options ask for; BadArgument for a file it cannot
    read or an output it cannot write."""
    from services.rpc.gen.darkroom.v1 import image_generation_pb2 as pb

    capability = capability_of(args)
    request = pb.SubmitJobRequest(
        model=args.model or "",
        prompt=prompt,
        negative_prompt=args.negative_prompt or "",
        width=args.width or 0,
        height=args.height or 0,
        steps=args.steps or 0,
        num_images=1,
        output_format=pb.OutputFormat.Value(_format(Path(args.output), capability)),
    )
    if args.seed is not None:
        request.seed = args.seed
    if args.guidance is not None:
        request.guidance_scale = args.guidance
    if getattr(args, "frames", None):
        request.frames = args.frames
    if getattr(args, "fps", None):
        request.fps = args.fps
    if getattr(args, "image", None):
        request.image = _read("--image", args.image)
    if getattr(args, "mask", None):
        request.mask = _read("--mask", args.mask)
    if getattr(args, "strength", None) is not None:
        request.strength = args.strength
    if getattr(args, "expand", None) is not None:  # unset: the tenant's default
        request.expand_prompt = args.expand
    request.adapters.extend(adapter(a) for a in getattr(args, "lora", []))
    return request


def adapter(option: str):
    """``--lora NAME[:VERSION][:SCALE]``: the last part a scale where it is a number
    (a version that is a number takes a scale after it: ``style:2:1``)."""
    from services.rpc.gen.darkroom.v1 import image_generation_pb2 as pb

    name, _, last = option.rpartition(":")
    try:
        scale = float(last) if name else None
    except ValueError:
        scale = None
    if scale is None:
        return pb.Adapter(name=option)
    return pb.Adapter(name=name, scale=scale)


def _format(output: Path, capability: str) -> str:
    suffixes = VIDEO_SUFFIXES if capability == "video" else IMAGE_SUFFIXES
    found = suffixes.get(output.suffix.lower())
    if found is None:
        kind = "a video" if capability == "video" else "an image"
        raise BadArgument(f"-o {output}: write {kind} to {', '.join(sorted(set(suffixes)))}")
    return found


def _read(option: str, path: str) -> bytes:
    try:
        return Path(path).expanduser().read_bytes()
    except OSError as exc:
        raise BadArgument(f"{option} {path}: {exc.strerror}") from None


def generate_into(address: str, prompt: str, args: argparse.Namespace, tls_roots: bytes | None = None) -> int:
    import grpc

    from services.rpc.client import JobFailed, generate

    try:
        request = build_request(prompt, args)
        job, images = generate(
            address, request, api_key=args.api_key, tls_roots=tls_roots, capability=capability_of(args)
        )
    except BadArgument as exc:
        print(f"darkroom: {exc}", file=sys.stderr)
        return 2
    except JobFailed as exc:
        print(f"darkroom: {exc}", file=sys.stderr)
        return 1
    except grpc.RpcError as exc:
        print(f"darkroom: {exc.code().name}: {exc.details()}", file=sys.stderr)  # type: ignore[attr-defined]
        return 1
    out = Path(args.output)
    made = images[0]
    if made.verdict == "blocked":
        print(f"darkroom: job {job.job_id}: its output was withheld (the image filter flagged it)", file=sys.stderr)
        return 1
    out.write_bytes(made.data)
    frames = f", {job.frames} frames at {job.fps:g} fps" if job.frames > 1 else ""
    print(
        f"darkroom: wrote {out} ({made.width}x{made.height}{frames}, seed {made.seed}, "
        f"{job.model}, job {job.job_id} on {job.worker_id})"
    )
    if job.expanded_prompt:
        print(f"darkroom: expanded prompt: {job.expanded_prompt}")
    if made.verdict:
        print(f"darkroom: the image filter {made.verdict} it (NSFW score {made.nsfw_score:.2f})")
    return 0


def _roots(args: argparse.Namespace) -> bytes | None:
    if args.tls_ca:
        try:
            return Path(args.tls_ca).expanduser().read_bytes()
        except OSError as exc:
            raise BadArgument(f"--tls-ca {args.tls_ca}: {exc.strerror}") from None
    return b"" if args.tls else None


def cmd_generate(args: argparse.Namespace) -> int:
    try:
        roots = _roots(args)
    except BadArgument as exc:
        print(f"darkroom: {exc}", file=sys.stderr)
        return 2
    return generate_into(args.gateway, args.prompt, args, roots)


def add_commands(sub: argparse._SubParsersAction) -> None:
    gen = sub.add_parser("generate", help="generate an image (or a video, or an edit) through a running gateway")
    gen.add_argument("prompt")
    _gateway_options(gen)
    add_options(gen)
    add_media_options(gen)
    gen.add_argument(
        "--expand",
        action=argparse.BooleanOptionalAction,
        help="expand the prompt with style phrases before sampling, seeded by --seed (default: the tenant's choice)",
    )
    gen.set_defaults(func=cmd_generate)

    up = sub.add_parser("upscale", help="make an image four times larger through a running gateway")
    up.add_argument("image", help="the image to upscale (PNG, JPEG or WebP)")
    up.add_argument("--prompt", default="", help="what the image shows (optional)")
    _gateway_options(up)
    add_options(up, output="upscaled.png")
    up.set_defaults(
        func=lambda a: cmd_generate(argparse.Namespace(**{**vars(a), "upscale": True, "prompt": a.prompt or "a photo"}))
    )


def _gateway_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gateway", default="127.0.0.1:50051")
    p.add_argument("--tls", action="store_true", help="reach the gateway over TLS (the system's CAs)")
    p.add_argument("--tls-ca", help="reach the gateway over TLS, trusting this CA certificate (PEM)")
