"""What a store's URL means: the one place that reads paths and URLs, by the rules of
"Paths and URLs" in docs/guide/remote.md. A URL shown to a person (errors, logs, reprs)
goes through :func:`redact` first, so a secret in it is never repeated, even in its refusal."""

from __future__ import annotations

import dataclasses
import os
import re
import urllib.parse

SCHEMES = ("file", "memory", "gs", "s3")
_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]+):")
_BAD_ESCAPE = re.compile(r"%(?![0-9A-Fa-f]{2})")
_CREDENTIALS_HOW = {
    "s3": "StoreOptions(credentials=...) (e.g. a profile) or --credentials TYPE, or the "
    "environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY)",
    "gs": "the environment (GOOGLE_APPLICATION_CREDENTIALS or gcloud's application "
    "default credentials)",
}


REDACTED = "REDACTED"
_URL_IN_TEXT = re.compile(r"\b[A-Za-z][A-Za-z0-9+.-]+://[^\s'\"]+")


def redact(url: str | os.PathLike[str]) -> str:
    """``url`` as it may be shown or saved: the user info (``USER:SECRET@``) and
    the values of the query and the fragment replaced by ``REDACTED``; a plain
    path as it is.

    Example:
        >>> redact("https://b.s3.amazonaws.com/x?X-Amz-Signature=abc&X-Amz-Date=1")
        'https://b.s3.amazonaws.com/x?X-Amz-Signature=REDACTED&X-Amz-Date=REDACTED'
        >>> redact("s3://KEY:SECRET@bucket/ds")
        's3://REDACTED@bucket/ds'
    """
    text = os.fspath(url)
    scheme = scheme_of(text)
    if not scheme:
        return text
    head, rest = text[: len(scheme) + 1], text[len(scheme) + 1 :]
    if rest.startswith("//"):
        # A secret may hold "/", "?" or "#": everything up to the last "@" goes.
        at = rest.rfind("@")
        if at >= 0:
            head, rest = head + "//" + REDACTED + "@", rest[at + 1 :]
    rest, hashed, _ = rest.partition("#")
    path, asked, query = rest.partition("?")
    if asked:
        path += "?" + "&".join(
            name + "=" + REDACTED if equals else REDACTED
            for name, equals, _ in (part.partition("=") for part in query.split("&"))
        )
    return head + path + (hashed and "#" + REDACTED)


def redact_text(text: str) -> str:
    """``text`` (a message of another library, say) with every URL in it redacted."""
    return _URL_IN_TEXT.sub(lambda m: redact(m.group(0)), text)


@dataclasses.dataclass(frozen=True)
class Location:
    """Where a URL points: ``scheme`` (``"file"`` for plain paths too), ``bucket``
    (``memory``: the name; ``""`` for files), and ``path``: the absolute local
    path, or the key prefix with no leading or trailing ``/``."""

    scheme: str
    bucket: str
    path: str


def scheme_of(url: str | os.PathLike[str]) -> str:
    """The URL's scheme, lower case, or ``""`` for a plain path (a one-letter
    scheme is a Windows drive, so a path)."""
    found = _SCHEME.match(os.fspath(url))
    return found.group(1).lower() if found else ""


def parse_url(url: str | os.PathLike[str]) -> Location:
    """The :class:`Location` of a local path or ``file://``, ``memory://``,
    ``gs://`` or ``s3://`` URL; ``ValueError`` naming the spelling that works."""
    text = os.fspath(url)
    if not text:
        raise ValueError("the store's URL is empty: give a path or a URL")
    scheme = scheme_of(text)
    if not scheme:
        return Location("file", "", os.path.abspath(os.path.expanduser(text)))
    if scheme not in SCHEMES:
        raise ValueError(
            f"unsupported URL scheme {scheme!r} in {redact(text)!r}: use a path or "
            f"one of {', '.join(s + '://' for s in SCHEMES)}"
        )
    rest = text[len(scheme) + 1 :]
    has_authority = rest.startswith("//")
    authority, slash, path = rest[2:].partition("/") if has_authority else ("", "", rest)
    # A secret may hold "/", "?" or "#", so the authority is cut at the first "/"
    # only; bucket names hold no ":" (an S3 secret key cut short still does).
    if "@" in authority or (scheme in ("gs", "s3") and ":" in authority):
        raise ValueError(
            f"a {scheme}:// URL must not carry credentials (USER:SECRET@ before the "
            f"bucket or host), and this one is not repeated here: write "
            f"{scheme}://{'BUCKET' if scheme in ('gs', 's3') else 'NAME'}/PATH and pass "
            f"credentials through {_CREDENTIALS_HOW.get(scheme, 'nothing: none are needed')}"
        )
    for char, escape in (("?", "%3F"), ("#", "%23")):
        if char in rest:
            raise ValueError(
                f"{redact(text)!r}: {char!r} starts a query or fragment, which store URLs do "
                f"not take; in a name, write it as {escape}"
            )
    bad = _BAD_ESCAPE.search(rest)
    if bad:
        raise ValueError(
            f"{redact(text)!r}: '%' at {len(scheme) + 1 + bad.start()} does not start a "
            "percent-escape (%XX); write a '%' in a URL as %25"
        )
    if scheme == "file":
        return Location("file", "", _file_path(text, has_authority, authority, slash + path))
    if not has_authority:
        raise ValueError(f"{text!r}: expected {scheme}://NAME/PATH")
    key = urllib.parse.unquote(path).strip("/")
    if scheme != "memory" and not authority:
        raise ValueError(f"{text!r} names no bucket: expected {scheme}://BUCKET/PATH")
    return Location(scheme, urllib.parse.unquote(authority), key)


def _file_path(text: str, has_authority: bool, host: str, path: str) -> str:
    """The local path of a ``file:`` URL (RFC 8089): absolute, on this host."""
    local = urllib.parse.unquote(path)
    if not has_authority and not local.startswith("/"):
        raise ValueError(
            f"{text!r}: a file: URL names an absolute path, as file:///ABSOLUTE/PATH; "
            f"for a path relative to the current directory, give the plain path {local!r}"
        )
    if host.lower() not in ("", "localhost"):
        meant = urllib.parse.unquote(host) + local
        absolute = "" if host in (".", "..", "~") else f"file:///{meant} for /{meant}, or "
        raise ValueError(
            f"{text!r}: a file:// URL's host is {host!r}, but only local files can be "
            f"read: write file:///ABSOLUTE/PATH (three slashes), e.g. {absolute}the plain "
            f"path {meant!r} for a path relative to the current directory"
        )
    if not local:
        raise ValueError(f"{text!r} names no path: write file:///ABSOLUTE/PATH")
    return os.path.normpath("/" + local.lstrip("/"))
