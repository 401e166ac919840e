//! Opening files kvscope follows or reads from places it does not control (a router
//! log path, a discovery folder): only regular files, and never blocking on the open.
//! A character device (`/dev/zero`) never ends, a FIFO's open and reads block until a
//! writer comes, a directory is no file: each is refused with what it is.

use std::fs::{File, Metadata};
use std::io;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::Path;

/// `O_NONBLOCK` (the same on every Linux architecture kvscope runs on: x86-64,
/// aarch64). A regular file ignores it; a FIFO swapped in after the look opens at once
/// instead of waiting for a writer, and is then refused.
const O_NONBLOCK: i32 = 0o4000;

/// Why `m` is not a regular file, as an error.
pub(crate) fn not_regular(m: &Metadata) -> io::Error {
    let t = m.file_type();
    let what = if t.is_char_device() {
        "a character device"
    } else if t.is_block_device() {
        "a block device"
    } else if t.is_fifo() {
        "a FIFO"
    } else if t.is_socket() {
        "a socket"
    } else if t.is_dir() {
        "a directory"
    } else {
        "not a file"
    };
    io::Error::new(
        io::ErrorKind::InvalidInput,
        format!("not a regular file ({what})"),
    )
}

/// `path` opened for reading if it is a regular file (links followed), with its
/// metadata; anything else refused with [`not_regular`]'s reason. Looked at before the
/// open (a FIFO's open would block) and again on the open file (the path may have been
/// swapped in between).
pub fn open_regular(path: &Path) -> io::Result<(File, Metadata)> {
    let m = std::fs::metadata(path)?;
    if !m.is_file() {
        return Err(not_regular(&m));
    }
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(O_NONBLOCK)
        .open(path)?;
    let m = f.metadata()?;
    if !m.is_file() {
        return Err(not_regular(&m));
    }
    Ok((f, m))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_regular_files_open_and_a_fifo_never_blocks() {
        let dir = tempfile_dir();
        let file = dir.join("a.log");
        std::fs::write(&file, "x").unwrap();
        assert_eq!(open_regular(&file).unwrap().1.len(), 1);
        let err = |p: &Path| open_regular(p).unwrap_err().to_string();
        assert_eq!(
            err(Path::new("/dev/zero")),
            "not a regular file (a character device)"
        );
        assert_eq!(err(&dir), "not a regular file (a directory)");
        let fifo = dir.join("fifo");
        let made = std::process::Command::new("mkfifo").arg(&fifo).status();
        if made.is_ok_and(|s| s.success()) {
            assert_eq!(err(&fifo), "not a regular file (a FIFO)");
        }
        assert_eq!(
            open_regular(&dir.join("missing")).unwrap_err().kind(),
            io::ErrorKind::NotFound
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A scratch folder of this test's own (the kit takes no dev-dependency for one).
    fn tempfile_dir() -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!("kvscope-kit-files-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        d
    }
}
