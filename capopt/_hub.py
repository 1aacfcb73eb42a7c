"""A Hugging Face Hub repo id (``meta-llama/Llama-3.1-8B``) as a model card: its ``config.json``.

The file is fetched with ``huggingface_hub`` (the optional ``hf`` extra), so its cache
(``HF_HUB_CACHE`` / ``HF_HOME``), its offline mode (``HF_HUB_OFFLINE=1``: the cache only) and
its token (``HF_TOKEN`` or ``hf auth login``) apply as they do for ``transformers``. Every
failure is one `CapoptError` line that says what to do; `capopt._cards` turns the file into
a card with `card_from_hf_config`.
"""

from __future__ import annotations

import logging
import re
import sys
from pathlib import Path

from ._errors import CapoptError

# owner/name[@revision]: Hub names are letters, digits, '-', '_' and '.' (huggingface_hub's
# validate_repo_id), at most 96 characters each
_REPO_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.\-]{0,95}/[\w.\-]{1,96})"
                      r"(?:@(?P<revision>[\w.\-/]{1,128}))?$")


def parse_repo_id(text: str) -> tuple[str, str | None] | None:
    """``(repo_id, revision)`` when ``text`` reads as a Hub repo id, else None."""
    m = _REPO_ID.match(text.strip())
    if not m or m.group("repo").endswith((".toml", ".json")) or ".." in m.group("repo"):
        return None
    return m.group("repo"), m.group("revision")


def hub_config_path(repo_id: str, revision: str | None = None, *,
                    field: str = "model.card") -> Path:
    """The local path of ``repo_id``'s ``config.json`` (downloaded into the Hub cache unless
    it is there already), or a `CapoptError` naming what went wrong and what to do."""
    where = repo_id + (f"@{revision}" if revision else "")
    try:
        import huggingface_hub
        from huggingface_hub import errors
    except ImportError:
        raise CapoptError(f"{where!r} reads as a Hugging Face repo id; resolving it needs "
                          "huggingface_hub: pip install 'capopt[hf]'", field=field) from None
    url = f"https://huggingface.co/{repo_id}"
    try:
        # a config.json already in the cache is used as it is (no request: fast, and the same
        # answer offline); `hf download REPO config.json` refreshes it
        cached = huggingface_hub.try_to_load_from_cache(repo_id, "config.json",
                                                        revision=revision)
        if isinstance(cached, str):
            return Path(cached)
        if not _offline():
            print(f"capopt: fetching {where}'s config.json from the Hugging Face Hub ...",
                  file=sys.stderr)
        # (the Hub client logs each retry; the one-line error below says what failed)
        hub_log = logging.getLogger("huggingface_hub")
        level = hub_log.level
        hub_log.setLevel(logging.ERROR)
        try:
            return Path(huggingface_hub.hf_hub_download(repo_id, "config.json",
                                                        revision=revision))
        finally:
            hub_log.setLevel(level)
    except errors.GatedRepoError:
        why = (f"{where}: a gated repo; accept its terms at {url} and log in "
               "(hf auth login) or set HF_TOKEN")
    except errors.RevisionNotFoundError:
        why = f"{where}: no revision {revision!r} on the Hugging Face Hub"
    except errors.RepositoryNotFoundError:
        why = (f"{where}: no such repo on the Hugging Face Hub (a private one needs "
               "hf auth login or HF_TOKEN)")
    except errors.LocalEntryNotFoundError:          # (a subclass of EntryNotFoundError)
        why = _not_cached(where)
    except errors.EntryNotFoundError:
        why = f"{where}: the repo has no config.json (not a transformers model?)"
    except errors.HFValidationError as e:
        why = f"{where}: not a valid Hugging Face repo id ({_first_line(e)})"
    except (errors.HfHubHTTPError, OSError, ValueError) as e:
        why = f"{where}: could not read config.json from the Hugging Face Hub ({_first_line(e)})"
    raise CapoptError(why, field=field)


def _offline() -> bool:
    from huggingface_hub import constants
    return bool(constants.HF_HUB_OFFLINE)


def _not_cached(where: str) -> str:
    from huggingface_hub import constants
    how = ("HF_HUB_OFFLINE is set" if _offline() else "the Hub could not be reached")
    return (f"{where}: config.json is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) "
            f"and {how}; download it once online, or give a config.json path")


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:200] if text else type(e).__name__


__all__ = ["hub_config_path", "parse_repo_id"]
