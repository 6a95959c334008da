"""What several command groups share: the methods a command takes, the help of the drafting options, and lists
of numbers on the command line."""

from ..cmdline import UsageError

METHODS = ("ar", "ngram", "eagle3", "dflash")
DRAFT_TREE_HELP = ("dflash, eagle3: verify a tree of the drafter's most likely continuations, --num-speculative-tokens "
                   "drafts in all, instead of a chain of its top guesses")
OPERATING_POINT_HELP = (DRAFT_TREE_HELP + "; --no-draft-tree: a chain (default: the drafter's recorded operating "
                        "point without --num-speculative-tokens, a chain with it)")
PROMPT_LOOKUP_HELP = ("dflash, eagle3: beside the drafts, verify up to N tokens that prompt lookup copies from the "
                      "sequence so far, 0 none (default: the drafter's recorded operating point without "
                      "--num-speculative-tokens, none with it)")


def int_list(text: str, flag: str) -> list[int]:
    """`--flag 1,2,4` -> [1, 2, 4]; anything else a UsageError naming the flag."""
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise UsageError(f"{flag} takes comma-separated integers, got {text!r}") from None
