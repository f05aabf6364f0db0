"""Private names of the libraries the package builds on, one module per library (`lightning`, `torch`,
`transformers`), each with the version its names were read from, so that a release that moves one breaks in
one place."""
