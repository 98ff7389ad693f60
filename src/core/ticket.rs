//! Tickets: their ids, labels and outcomes.

use super::errors::QuotaError;

/// Labels are for humans reading `quota.usage` and the ledger; 200 characters is
/// plenty for a job name and keeps a request slot in shared memory small.
pub const MAX_LABEL_CHARS: usize = 200;

/// The longest label in bytes: 200 characters of at most 4 bytes each in UTF-8.
pub const MAX_LABEL_BYTES: usize = MAX_LABEL_CHARS * 4;

pub fn check_label(label: &str) -> Result<(), QuotaError> {
    let chars = label.chars().count();
    if chars > MAX_LABEL_CHARS {
        return Err(QuotaError::LabelTooLong { chars });
    }
    Ok(())
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

/// Parses the outcome a caller passes to `finish()`. Matching is exact, as for an enum
/// label in PostgreSQL: `'Succeeded'` is not an outcome.
pub fn parse_outcome(text: &str) -> Result<Outcome, QuotaError> {
    match text {
        "succeeded" => Ok(Outcome::Succeeded),
        "failed" => Ok(Outcome::Failed),
        "cancelled" => Ok(Outcome::Cancelled),
        other => Err(QuotaError::InvalidOutcome(other.to_string())),
    }
}

/// Builds a version 7 UUID (RFC 9562) from a Unix time in microseconds and 8 random
/// bytes, ordered after `prev` (the last id this process issued, if any).
///
/// The 48-bit field holds milliseconds and the 12 bits after the version hold the
/// sub-millisecond fraction (RFC 9562, method 3), so ids sort in start order. Ids
/// issued in the same instant, as in one writer batch, would tie on time, so an id
/// that would not sort after `prev` becomes `prev` plus one in its random bits
/// (RFC 9562, monotonic random). Time-ordered ids also keep the ledger's primary key
/// index append-mostly, which keeps inserts cheap.
pub fn uuid_v7(unix_us: u64, random: [u8; 8], prev: Option<[u8; 16]>) -> [u8; 16] {
    let ms = unix_us / 1000;
    let frac = ((unix_us % 1000) * 4096 / 1000) as u16; // 12 bits
    let mut b = [0u8; 16];
    b[..6].copy_from_slice(&ms.to_be_bytes()[2..]);
    b[6..8].copy_from_slice(&(0x7000 | frac).to_be_bytes()); // version 7
    b[8..].copy_from_slice(&random);
    b[8] = (b[8] & 0x3f) | 0x80; // RFC 9562 variant
    match prev {
        Some(p) if b <= p => successor(p),
        _ => b,
    }
}

/// The smallest version 7 id greater than `p`: one more in the 62 random bits after
/// the variant, carrying into the 12 bits after the version, then into the time.
fn successor(p: [u8; 16]) -> [u8; 16] {
    let v = u128::from_be_bytes(p);
    let rand_b = v & ((1u128 << 62) - 1);
    let rand_a = (v >> 64) & 0xfff;
    let time = v >> 80;
    let (time, rand_a, rand_b) = if rand_b < (1u128 << 62) - 1 {
        (time, rand_a, rand_b + 1)
    } else if rand_a < 0xfff {
        (time, rand_a + 1, 0)
    } else {
        (time + 1, 0, 0)
    };
    let v = (time << 80) | (0x7u128 << 76) | (rand_a << 64) | (0b10u128 << 62) | rand_b;
    v.to_be_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn label_of_200_characters_is_accepted() {
        assert!(check_label(&"é".repeat(200)).is_ok());
    }

    #[test]
    fn label_of_201_characters_is_refused_with_22001() {
        let e = check_label(&"x".repeat(201)).unwrap_err();
        assert_eq!(e, QuotaError::LabelTooLong { chars: 201 });
        assert_eq!(e.sqlstate().code(), "22001");
    }

    #[test]
    fn longest_label_fits_in_a_slot() {
        assert!("\u{10FFFF}".repeat(MAX_LABEL_CHARS).len() <= MAX_LABEL_BYTES);
    }

    #[test]
    fn outcomes_round_trip() {
        for o in [Outcome::Succeeded, Outcome::Failed, Outcome::Cancelled] {
            assert_eq!(parse_outcome(o.as_str()).unwrap(), o);
        }
    }

    #[test]
    fn unknown_outcome_is_22023() {
        for bad in ["", "Succeeded", "expired", "done"] {
            let e = parse_outcome(bad).unwrap_err();
            assert_eq!(e.sqlstate().code(), "22023");
        }
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
}
