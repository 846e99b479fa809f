"""Calibration documents to token ids in bounded memory (one 200 MB line had taken 19.7 GB to tokenize).

A fast tokenizer's encoding of one text holds offsets, word ids and more per token: tens of bytes per character
of input, all at once. So documents are tokenized a few at a time, and a document longer than CHUNK_CHARS in
pieces of at most that many characters, cut at whitespace (a piece starts with the space before its first word,
as the whole text's tokenization would see it), until DOC_TOKEN_CAP tokens: a run draws its seqlen-token
segments from random places of random documents, steps x batch size of them, and a document longer than that
cap gives it nothing it can use. Documents up to CHUNK_CHARS (every C4 document) tokenize exactly as the whole
list would; a longer one may differ near its cuts (the tiny model's tokenizer: 4 of 120,451 tokens differed over 4
cuts). A 175 MB one-line file is read and tokenized in 761 MB peak RSS (imports included), not ~100x the file."""

from __future__ import annotations

CHUNK_CHARS = 1 << 16  # characters tokenized at once: a few MB of the tokenizer's memory
DOCS_AT_ONCE = 256  # short documents tokenized per call
DOC_TOKEN_CAP = 1 << 20  # tokens kept of one document (about 4 MB of text): more than a run draws from it


def pieces(text: str, chunk: int = CHUNK_CHARS):
    """The text in consecutive pieces of at most `chunk` characters, each cut before a whitespace character
    where the chunk holds one (else at `chunk`); joined, they are the text."""
    start = 0
    while start < len(text):
        end = start + chunk
        if end < len(text):
            cut = max(text.rfind(c, start + 1, end + 1) for c in " \n\t")
            end = cut if cut > start else end
        yield text[start:end]
        start = end


def long_document_ids(tokenizer, text: str, cap: int = DOC_TOKEN_CAP, chunk: int = CHUNK_CHARS) -> list[int]:
    """The token ids of one long text, tokenized piece by piece, at most `cap` of them (the text's start)."""
    ids: list[int] = []
    for piece in pieces(text, chunk):
        ids += tokenizer(piece, add_special_tokens=False)["input_ids"]
        if len(ids) >= cap:
            return ids[:cap]
    return ids


def tokenize_documents(tokenizer, texts: list[str], cap: int = DOC_TOKEN_CAP, chunk: int = CHUNK_CHARS,
                       at_once: int = DOCS_AT_ONCE) -> list[list[int]]:
    """Each text's token ids (no special tokens), as `tokenizer(texts)["input_ids"]` gives them for texts up to
    `chunk` characters; longer texts in pieces and cut at `cap` tokens (see the module's note)."""
    out: list[list[int]] = []
    short: list[int] = []  # indices of the texts waiting to be tokenized together

    def flush() -> None:
        if short:
            for i, ids in zip(short, tokenizer([texts[i] for i in short], add_special_tokens=False)["input_ids"]):
                out[i] = ids
            short.clear()

    for i, text in enumerate(texts):
        out.append([])
        if len(text) > chunk:
            out[i] = long_document_ids(tokenizer, text, cap, chunk)
        else:
            short.append(i)
            if len(short) >= at_once:
                flush()
    flush()
    return [ids[:cap] for ids in out]
