//! Workspace-level end-to-end and fault tests live in `tests/`.
