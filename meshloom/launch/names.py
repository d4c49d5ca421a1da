"""Names a launch hands to a scheduler, checked by the rules of the system that will read them.

Checked before anything is planned or written, so a name the scheduler would reject (or a shell would split) is
one line here, not a failed submission later.
- Kubernetes: a TrainJob name is an RFC 1035 label (lower-case letters, digits and '-', starting with a letter,
  ending with a letter or digit, at most 63); a PersistentVolumeClaim name is a DNS-1123 subdomain (lower-case
  letters, digits, '-' and '.', each dot-separated part starting and ending with a letter or digit, at most 253).
- A container image is a reference as registries parse it: [host[:port]/]path[:tag][@digest].
- SLURM and Ray: the job name goes into an `#SBATCH --job-name=` line and Ray's run folder name, so it is one
  word of letters, digits, '.', '_' and '-' (no spaces, quotes, slashes or shell characters), at most 128.
"""

from __future__ import annotations

import re

from meshloom.config.errors import UserError

_RFC1035_LABEL = re.compile(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?")
_DNS1123_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS1123_SUBDOMAIN = re.compile(rf"{_DNS1123_LABEL}(\.{_DNS1123_LABEL})*")
_JOB_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
# The reference grammar of the container registries (distribution/reference), without its rarely used IPv6 hosts.
_PATH_PART = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_HOST = r"(?:[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?(?:\.[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?)*(?::[0-9]+)?)"
_IMAGE = re.compile(rf"(?:{_HOST}/)?{_PATH_PART}(?:/{_PATH_PART})*(?::[\w][\w.-]{{0,127}})?(?:@[a-z0-9]+(?:[.+_-][a-z0-9]+)*:[0-9a-fA-F]{{32,}})?")


def check_trainjob_name(name: str) -> None:
    if not _RFC1035_LABEL.fullmatch(name):
        raise UserError(
            f"--name {name!r} is not a valid TrainJob name (Kubernetes: an RFC 1035 label); use at most 63 lower-case "
            f"letters, digits and '-', starting with a letter and ending with a letter or digit"
        )


def check_claim_name(flag: str, name: str) -> None:
    if len(name) > 253 or not _DNS1123_SUBDOMAIN.fullmatch(name):
        raise UserError(
            f"{flag} {name!r} is not a valid PersistentVolumeClaim name (Kubernetes: a DNS-1123 subdomain); use at most "
            f"253 lower-case letters, digits, '-' and '.', each part starting and ending with a letter or digit"
        )


def check_image(image: str) -> None:
    if len(image) > 255 or not _IMAGE.fullmatch(image):
        raise UserError(
            f"--image {image!r} is not a container image reference; give [REGISTRY/]REPOSITORY[:TAG][@DIGEST] with a "
            f"lower-case repository, e.g. registry.example/meshloom:1.0"
        )


def check_job_name(scheduler: str, name: str) -> None:
    if not _JOB_NAME.fullmatch(name):
        raise UserError(
            f"--name {name!r} is not a valid {scheduler} job name here; use one word of at most 128 letters, digits, "
            f"'.', '_' and '-', starting with a letter or digit (it goes into the job script and a folder name)"
        )
