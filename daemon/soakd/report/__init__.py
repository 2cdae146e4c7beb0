"""Reading a finished run back: re-judging it from its folder, the sign-off report, comparisons."""
