"""What every part of cullama may import: the error types and the reading of untrusted input."""
