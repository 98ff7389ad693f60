//! Layer 1: text between the server encoding and Rust's strings, for messages (0.5.2).
//!
//! PostgreSQL's own messages put a name in as its bytes, in the server encoding, and
//! convert the whole message for the client when they send it. pg_quota composes its
//! messages in Rust strings (core/), so a name crosses twice: into a `String` with
//! `server_text` (converted to UTF-8, not cut down to its valid UTF-8 bytes: 0.5.1 read
//! a LATIN1 `café` as `caf\u{FFFD}`), and back with `to_server` when the message is
//! raised (error.rs). Both conversions are PostgreSQL's own, between the server
//! encoding and UTF-8, so a name comes out as the bytes it went in as. Neither raises:
//! a character with no equivalent on the other side becomes `?`, as a message must not
//! fail for want of a character.
//!
//! SQL_ASCII has no encoding to convert from: its bytes are taken as UTF-8 where they
//! are valid, and `?` elsewhere.

use pgrx::pg_sys;

/// PostgreSQL's MAX_CONVERSION_GROWTH: a character converts to at most this many bytes
/// per byte.
const MAX_GROWTH: usize = 4;

fn server_encoding() -> i32 {
    // SAFETY: a plain read of backend state.
    unsafe { pg_sys::GetDatabaseEncoding() }
}

const UTF8: i32 = pg_sys::pg_enc::PG_UTF8 as i32;
const SQL_ASCII: i32 = pg_sys::pg_enc::PG_SQL_ASCII as i32;

/// `bytes`, text in the server encoding, as a Rust string.
pub fn server_text(bytes: &[u8]) -> String {
    let enc = server_encoding();
    if enc == UTF8 || enc == SQL_ASCII || bytes.is_ascii() {
        return String::from_utf8_lossy(bytes).into_owned();
    }
    String::from_utf8_lossy(&convert(bytes, enc, UTF8)).into_owned()
}

/// `text` in the server encoding, as a message's bytes are sent: what `server_text`
/// read comes back as it was.
pub fn to_server(text: &str) -> Vec<u8> {
    let enc = server_encoding();
    if enc == UTF8 || enc == SQL_ASCII || text.is_ascii() {
        return text.as_bytes().to_vec();
    }
    convert(text.as_bytes(), UTF8, enc)
}

/// `src` converted from encoding `from` to `to` with PostgreSQL's default conversion,
/// each character that has no equivalent (or is not valid in `from`) as `?`.
fn convert(src: &[u8], from: i32, to: i32) -> Vec<u8> {
    // SAFETY: a catalog lookup (pg_conversion's syscache), made only inside a
    // transaction (the writer logs some lines between its transactions): elsewhere
    // every non-ASCII character becomes '?'. InvalidOid if there is no conversion.
    let proc_ = unsafe {
        if pg_sys::IsTransactionState() {
            pg_sys::FindDefaultConversionProc(from, to)
        } else {
            pg_sys::InvalidOid
        }
    };
    let mut out = Vec::with_capacity(src.len());
    let mut rest = src;
    while !rest.is_empty() {
        let done = if proc_ == pg_sys::InvalidOid {
            0
        } else {
            let mut input = rest.to_vec();
            let mut buf = vec![0u8; rest.len() * MAX_GROWTH + 8];
            // SAFETY: `input` holds `rest.len()` bytes; `buf` has room for the worst
            // case and the terminating NUL the conversion writes, so nothing is cut
            // short; with noError the conversion stops at a character it cannot
            // convert instead of raising, and returns how many input bytes it took.
            let done = unsafe {
                pg_sys::pg_do_encoding_conversion_buf(
                    proc_,
                    from,
                    to,
                    input.as_mut_ptr(),
                    input.len() as i32,
                    buf.as_mut_ptr(),
                    buf.len() as i32,
                    true,
                )
            };
            let written = buf.iter().position(|&b| b == 0).unwrap_or(0);
            out.extend_from_slice(&buf[..written]);
            usize::try_from(done).unwrap_or(0).min(rest.len())
        };
        rest = &rest[done..];
        if let Some(&first) = rest.first() {
            // The character at `rest` could not be converted (or there is no
            // conversion: ASCII is the same in every server encoding): skip it whole.
            out.push(if first.is_ascii() { first } else { b'?' });
            let len = if first.is_ascii() {
                1
            } else {
                // The character's first bytes, NUL-terminated: the bounded mblen never
                // reads past a NUL, whatever the encoding looks at.
                let mut head = [0u8; 8];
                let n = rest.len().min(head.len() - 1);
                head[..n].copy_from_slice(&rest[..n]);
                // SAFETY: `head` is NUL-terminated.
                let n = unsafe { pg_sys::pg_encoding_mblen_bounded(from, head.as_ptr().cast()) };
                usize::try_from(n).unwrap_or(1).clamp(1, rest.len())
            };
            rest = &rest[len..];
        }
    }
    out
}
