//! Tickets: their ids, labels and outcomes.

use super::errors::QuotaError;

/// Labels are for humans reading `quota.usage` and the ledger; 200 characters is
/// plenty for a job name and keeps a request slot in shared memory small.
pub const MAX_LABEL_CHARS: usize = 200;

/// The most bytes one character takes in any server encoding PostgreSQL supports
/// (`pg_encoding_max_length`: 4 for UTF8, EUC_TW and GB18030).
pub const MAX_CHAR_BYTES: usize = 4;

/// The longest label in bytes, in any server encoding.
pub const MAX_LABEL_BYTES: usize = MAX_LABEL_CHARS * MAX_CHAR_BYTES;

/// Checks a label that has `chars` characters in `bytes` bytes of the server encoding.
/// Labels stay in the server encoding end to end (a LATIN1 or SQL_ASCII database has
/// labels that are not UTF-8), so the caller counts characters with the server's own
/// rules and passes both numbers.
pub fn check_label(chars: usize, bytes: usize) -> Result<(), QuotaError> {
    check_text(MAX_LABEL_CHARS, chars, bytes).map_err(|chars| QuotaError::LabelTooLong {
        chars,
        max: MAX_LABEL_CHARS,
    })
}

/// Err(the length to report) when text of `chars` characters in `bytes` bytes is
/// longer than `max_chars` characters. The byte check can only fail on a server that
/// reported more bytes per character than any encoding has: refuse rather than
/// overflow a request slot.
fn check_text(max_chars: usize, chars: usize, bytes: usize) -> Result<(), usize> {
    if chars > max_chars {
        return Err(chars);
    }
    if bytes > max_chars * MAX_CHAR_BYTES {
        return Err(bytes);
    }
    Ok(())
}

/// Idempotency keys: like labels, at most 200 characters in the server encoding.
pub const MAX_KEY_CHARS: usize = 200;
pub const MAX_KEY_BYTES: usize = MAX_KEY_CHARS * MAX_CHAR_BYTES;

/// Checks an idempotency key of `chars` characters in `bytes` bytes, as `check_label`.
pub fn check_key(chars: usize, bytes: usize) -> Result<(), QuotaError> {
    check_text(MAX_KEY_CHARS, chars, bytes).map_err(|chars| QuotaError::KeyTooLong {
        chars,
        max: MAX_KEY_CHARS,
    })
}

/// A tenant's text (0.5.0) follows the label's rules: at most this many characters.
pub const MAX_TENANT_CHARS: usize = 200;
pub const MAX_TENANT_BYTES: usize = MAX_TENANT_CHARS * MAX_CHAR_BYTES;

/// Checks a tenant of `chars` characters in `bytes` bytes, as `check_label`.
pub fn check_tenant(chars: usize, bytes: usize) -> Result<(), QuotaError> {
    check_text(MAX_TENANT_CHARS, chars, bytes).map_err(|chars| QuotaError::TenantTooLong {
        chars,
        max: MAX_TENANT_CHARS,
    })
}

/// Checks a start's `weight`: NULL raises 22004, a weight below 1 or above MAX_WEIGHT
/// 22023.
pub fn check_weight(weight: Option<i32>) -> Result<i64, QuotaError> {
    let w = i64::from(weight.ok_or(QuotaError::NullArgument("weight"))?);
    if (1..=super::decision::MAX_WEIGHT).contains(&w) {
        Ok(w)
    } else {
        Err(QuotaError::InvalidWeight { value: w })
    }
}

/// How a ticket ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    Succeeded,
    Failed,
    Cancelled,
}

impl Outcome {
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Succeeded => "succeeded",
            Outcome::Failed => "failed",
            Outcome::Cancelled => "cancelled",
        }
    }
}

/// Parses the outcome a caller passes to `finish()`, as the bytes of the server
/// encoding. Matching is exact, as for an enum label in PostgreSQL: `'Succeeded'` is
/// not an outcome. Every outcome is ASCII, which reads the same in every server
/// encoding.
pub fn parse_outcome(text: &[u8]) -> Result<Outcome, QuotaError> {
    match text {
        b"succeeded" => Ok(Outcome::Succeeded),
        b"failed" => Ok(Outcome::Failed),
        b"cancelled" => Ok(Outcome::Cancelled),
        other => Err(QuotaError::InvalidOutcome(printable(other))),
    }
}

/// Text from the server encoding made safe to quote in a message: valid UTF-8 is kept
/// (the server encoding of most databases), anything else shows its non-ASCII bytes
/// as `\xNN`, which reads the same in every encoding.
pub fn printable(bytes: &[u8]) -> String {
    match std::str::from_utf8(bytes) {
        Ok(s) => s.to_string(),
        Err(_) => bytes
            .iter()
            .map(|&b| {
                if b.is_ascii() && !b.is_ascii_control() {
                    (b as char).to_string()
                } else {
                    format!("\\x{b:02X}")
                }
            })
            .collect(),
    }
}

/// `text` with every character outside printable ASCII written as `\uXXXX` (or
/// `\UXXXXXXXX`), and cut to `max` characters (then ending in `...`): for a WARNING that
/// quotes a job's data, which PostgreSQL converts to the client's encoding as it sends
/// it. A character the client's encoding lacks would raise an ERROR from inside the
/// report (error::warn), and the data may be long; ASCII reads the same in every
/// encoding.
pub fn ascii_escaped(text: &str, max: usize) -> String {
    let mut out = String::new();
    for (n, c) in text.chars().enumerate() {
        if n == max {
            out.push_str("...");
            break;
        }
        match c as u32 {
            0x20..=0x7E => out.push(c),
            u @ 0..=0xFFFF => out.push_str(&format!("\\u{u:04X}")),
            u => out.push_str(&format!("\\U{u:08X}")),
        }
    }
    out
}

/// Builds a version 7 UUID (RFC 9562) from a Unix time in microseconds and 8 random
/// bytes, ordered after `prev` (the last id this process issued, if any).
///
/// The `uuid` crate lays the id out (`Builder::from_unix_timestamp_millis`: the 48-bit
/// millisecond field, the version and the variant); the 12 bits after the version hold
/// the sub-millisecond fraction (RFC 9562, method 3), so ids sort in start order, and
/// the 62 bits after the variant are the caller's random bytes, which the writer draws
/// from `pg_strong_random`. Ids issued in the same instant, as in one writer batch,
/// would tie on time, so an id that would not sort after `prev` becomes `prev` plus
/// one in those 74 bits (RFC 9562, monotonic random). The crate's own monotonic
/// generator (`ContextV7` with `Uuid::new_v7`) is not used because it fills the random
/// bits from the crate's RNG, which cannot be pointed at `pg_strong_random`.
/// Time-ordered ids also keep the ledger's primary key index append-mostly, which
/// keeps inserts cheap.
pub fn uuid_v7(unix_us: u64, random: [u8; 8], prev: Option<[u8; 16]>) -> [u8; 16] {
    let frac = u128::from((unix_us % 1000) * 4096 / 1000); // 12 bits
    let id = v7(
        unix_us / 1000,
        frac << 62 | u128::from(u64::from_be_bytes(random) >> 2),
    );
    match prev {
        Some(p) if id <= p => successor(p),
        _ => id,
    }
}

/// The bits of a version 7 id after its version and variant: rand_a (12) and rand_b (62).
const PAYLOAD_BITS: u32 = 74;

/// The version 7 id of `ms` whose 74 payload bits are `payload`.
fn v7(ms: u64, payload: u128) -> [u8; 16] {
    let rand_a = (payload >> 62) as u16;
    let rand_b = payload as u64 & ((1 << 62) - 1);
    let mut bytes = [0u8; 10];
    bytes[..2].copy_from_slice(&rand_a.to_be_bytes());
    bytes[2..].copy_from_slice(&rand_b.to_be_bytes());
    uuid::Builder::from_unix_timestamp_millis(ms, &bytes)
        .into_uuid()
        .into_bytes()
}

/// The smallest version 7 id greater than `p`: one more in its payload, carrying into
/// the time.
fn successor(p: [u8; 16]) -> [u8; 16] {
    let v = u128::from_be_bytes(p);
    let payload = ((v >> 64) & 0xfff) << 62 | (v & ((1 << 62) - 1));
    let ms = (v >> 80) as u64;
    if payload + 1 < 1 << PAYLOAD_BITS {
        v7(ms, payload + 1)
    } else {
        v7(ms + 1, 0)
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_weight_is_1_to_a_million() {
        assert_eq!(check_weight(Some(1)), Ok(1));
        assert_eq!(check_weight(Some(1_000_000)), Ok(1_000_000));
        for bad in [0, -1, 1_000_001, i32::MIN, i32::MAX] {
            let e = check_weight(Some(bad)).unwrap_err();
            assert_eq!(
                e.sqlstate(),
                crate::core::errors::Sqlstate::InvalidParameterValue,
                "{bad}"
            );
            assert_eq!(e.to_string(), format!("invalid weight {bad}"));
        }
        let e = check_weight(None).unwrap_err();
        assert_eq!(
            e.sqlstate(),
            crate::core::errors::Sqlstate::NullValueNotAllowed
        );
        assert_eq!(e.to_string(), "weight must not be null");
    }

    use super::*;

    #[test]
    fn ascii_escaped_reads_the_same_in_every_encoding() {
        assert_eq!(
            ascii_escaped("t\u{e2}che-\u{65e5}\n\u{1F600}", 64),
            "t\\u00E2che-\\u65E5\\u000A\\U0001F600"
        );
        assert_eq!(
            ascii_escaped(&"x".repeat(70), 64),
            format!("{}...", "x".repeat(64))
        );
        assert_eq!(ascii_escaped("plain", 5), "plain");
    }

    #[test]
    fn label_of_200_four_byte_characters_is_accepted() {
        let l = "\u{10FFFF}".repeat(200);
        assert!(check_label(l.chars().count(), l.len()).is_ok());
    }

    #[test]
    fn label_of_201_characters_is_refused_with_22001() {
        let e = check_label(201, 201).unwrap_err();
        assert_eq!(
            e,
            QuotaError::LabelTooLong {
                chars: 201,
                max: 200
            }
        );
        assert_eq!(e.sqlstate().code(), "22001");
    }

    #[test]
    fn label_with_more_bytes_than_a_slot_holds_is_refused() {
        assert!(check_label(200, MAX_LABEL_BYTES + 1).is_err());
    }

    #[test]
    fn outcomes_round_trip() {
        for o in [Outcome::Succeeded, Outcome::Failed, Outcome::Cancelled] {
            assert_eq!(parse_outcome(o.as_str().as_bytes()).unwrap(), o);
        }
    }

    #[test]
    fn unknown_outcome_is_22023() {
        // "expired" is an outcome only the lease clock gives (see core::lease).
        for bad in [&b""[..], b"Succeeded", b"expired", b"done", b"d\xf6n"] {
            let e = parse_outcome(bad).unwrap_err();
            assert_eq!(e.sqlstate().code(), "22023");
        }
    }

    #[test]
    fn outcome_in_a_latin1_database_is_quoted_safely() {
        // "dön" in LATIN1: the ö is one byte, 0xF6, which is not UTF-8.
        let e = parse_outcome(b"d\xf6n").unwrap_err();
        assert_eq!(e.to_string(), "invalid outcome \"d\\xF6n\"");
        assert_eq!(printable("dön".as_bytes()), "dön");
    }

    fn is_v7(id: [u8; 16]) -> bool {
        id[6] >> 4 == 7 && id[8] >> 6 == 0b10
    }

    #[test]
    fn uuid_v7_has_version_variant_and_time() {
        let id = uuid_v7(0x0123_4567_89ab * 1000 + 999, [0xff; 8], None);
        assert_eq!(&id[..6], &[0x01, 0x23, 0x45, 0x67, 0x89, 0xab]);
        assert!(is_v7(id));
        // 999 us is the top of the 12-bit sub-millisecond fraction
        assert_eq!(u16::from_be_bytes([id[6], id[7]]) & 0x0fff, 4091);
    }

    #[test]
    fn uuid_v7_sorts_by_time_to_the_microsecond() {
        assert!(uuid_v7(1_000_000, [0xff; 8], None) < uuid_v7(1_001_000, [0; 8], None));
        assert!(uuid_v7(1_000_001, [0xff; 8], None) < uuid_v7(1_000_002, [0; 8], None));
    }

    #[test]
    fn uuid_v7_issued_in_the_same_instant_still_increase() {
        let mut prev = None;
        for i in 0..1000u32 {
            let random = [(i % 7) as u8; 8];
            let id = uuid_v7(5_000_000, random, prev);
            assert!(is_v7(id));
            if let Some(p) = prev {
                assert!(id > p);
            }
            prev = Some(id);
        }
    }

    #[test]
    fn uuid_v7_successor_carries() {
        let top = uuid_v7(7_000_000, [0xff; 8], None);
        let next = uuid_v7(7_000_000, [0; 8], Some(top));
        assert!(next > top && is_v7(next));
        assert_eq!(
            &next[..6],
            &top[..6],
            "carried into the sub-millisecond bits, not the time"
        );
    }

    #[test]
    fn uuid_v7_successor_of_a_full_payload_carries_into_the_time() {
        let top = v7(9_000, (1 << PAYLOAD_BITS) - 1);
        let next = successor(top);
        assert!(next > top && is_v7(next));
        assert_eq!(next, v7(9_001, 0));
    }

    #[test]
    fn uuid_v7_reads_back_through_the_uuid_crate() {
        let unix_us = 1_700_000_000_123_456u64;
        let u = uuid::Uuid::from_bytes(uuid_v7(unix_us, [0x5a; 8], None));
        assert_eq!(u.get_version(), Some(uuid::Version::SortRand));
        assert_eq!(u.get_variant(), uuid::Variant::RFC4122);
        let (secs, nanos) = u.get_timestamp().unwrap().to_unix();
        assert_eq!(secs * 1000 + u64::from(nanos) / 1_000_000, unix_us / 1000);
        // the random bytes are kept (all 62 bits of them that fit)
        assert_eq!(
            u64::from_be_bytes(u.as_bytes()[8..].try_into().unwrap()) & ((1 << 62) - 1),
            0x5a5a_5a5a_5a5a_5a5a >> 2
        );
    }

    proptest::proptest! {
        #[test]
        fn uuid_v7_is_monotonic(steps in proptest::collection::vec((0u64..3, proptest::array::uniform8(0u8..)), 1..200)) {
            let mut prev: Option<[u8; 16]> = None;
            let mut t = 1_700_000_000_000_000u64;
            for (dt, random) in steps {
                t += dt;
                let id = uuid_v7(t, random, prev);
                proptest::prop_assert!(is_v7(id));
                if let Some(p) = prev {
                    proptest::prop_assert!(id > p);
                }
                prev = Some(id);
            }
        }
    }

    #[test]
    fn keys_are_limited_like_labels() {
        assert!(check_key(200, 800).is_ok());
        let e = check_key(201, 201).unwrap_err();
        assert_eq!(e.sqlstate().code(), "22001");
        assert_eq!(
            e.detail().unwrap(),
            "The key has 201 characters; at most 200 are allowed."
        );
        assert!(check_key(10, 801).is_err());
    }
}
