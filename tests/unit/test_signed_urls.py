"""Signed links to results: good until they expire, for the output they name, under
the key they were signed with."""

from __future__ import annotations

from urllib.parse import parse_qs, urlsplit

import pytest

from http_api.signed_urls import UrlSigner, malformed

SIGNER = UrlSigner(b"k" * 32, ttl_s=60)


def parts(path: str) -> tuple[str, int, str, str]:
    split = urlsplit(path)
    _, _, _, job, index = split.path.split("/")
    query = parse_qs(split.query)
    return job, int(index), query["expires"][0], query["signature"][0]


def test_a_link_is_good_until_it_expires() -> None:
    job, index, expires, signature = parts(SIGNER.path("job-1", 2, now=1000.0))
    assert (job, index, expires) == ("job-1", 2, "1060")
    assert SIGNER.refusal(job, index, expires, signature, now=1059.0) == ""
    assert SIGNER.refusal(job, index, expires, signature, now=1061.0) == "the link has expired"


def test_a_link_names_one_output_under_one_key() -> None:
    job, index, expires, signature = parts(SIGNER.path("job-1", 0, now=1000.0))
    mismatch = "the link's signature does not match"
    assert SIGNER.refusal(job, 1, expires, signature, now=1000.0) == mismatch
    assert SIGNER.refusal("job-2", index, expires, signature, now=1000.0) == mismatch
    assert SIGNER.refusal(job, index, str(int(expires) + 600), signature, now=1000.0) == mismatch
    assert UrlSigner(b"o" * 32, 60).refusal(job, index, expires, signature, now=1000.0) == mismatch
    assert SIGNER.refusal(job, index, "soon", signature, now=1000.0).startswith("expires must be")


@pytest.mark.parametrize(
    ("expires", "signature", "param"),
    [
        ("", "ab", "expires"),
        ("soon", "ab", "expires"),
        ("1²", "ab", "expires"),  # a digit to str.isdigit, not to int()
        ("\u0661\u0660\u0660\u0660", "ab", "expires"),  # Arabic-Indic digits: int() reads them, a link never has them
        ("9" * 5000, "ab", "expires"),  # past int()'s 4,300 digits
        ("1060", "", "signature"),
        ("1060", "é" * 64, "signature"),  # compare_digest raises TypeError on non-ASCII text
        ("1060", "zz", "signature"),
        ("1060", "a" * 129, "signature"),
    ],
)
def test_a_link_no_signer_writes_is_named_before_any_check(expires: str, signature: str, param: str) -> None:
    bad = malformed(expires, signature)
    assert bad is not None and bad[0] == param
    assert SIGNER.refusal("job-1", 0, expires, signature, now=1000.0) == bad[1]
