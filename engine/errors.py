"""The one exception type that means "the user asked for something we cannot do"."""


MAX_LINE = 300  # characters of an error line, at most (an OS error can run to 800: it is shortened)


class UserError(Exception):
    """Bad input: shown to the user as one line, never as a traceback."""


def shorten(text: str, limit: int = MAX_LINE) -> str:
    """text on one line (runs of whitespace, newlines too, made one space), at most `limit` characters: a longer
    one keeps its start and its end (where the remedy is said) around " ... "."""
    text = " ".join(str(text).split())
    if len(text) <= limit:
        return text
    tail = limit // 3
    return text[: limit - tail - 5] + " ... " + text[-tail:]
