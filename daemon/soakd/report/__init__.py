"""Report: the acceptance criteria, the verdict, and reading a finished run back."""
