//! Human units in configs and on the command line: `2GiB`, `512MiB`,
//! `5m`, `500ms`. A bare number is bytes or seconds.

use std::time::Duration;

/// Parses `120`, `120s`, `2m`, `1h 30m`, `500ms`: a bare number is seconds.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    if let Ok(secs) = text.parse::<f64>() {
        // `try_`: `from_secs_f64` panics past u64::MAX seconds (`1e20`).
        return Duration::try_from_secs_f64(secs)
            .map_err(|_| format!("`{text}` is not a duration (a number of seconds from 0)"));
    }
    humantime::parse_duration(text)
        .map_err(|e| format!("`{text}` is not a duration ({e}); try 30s, 5m, 500ms"))
}

/// A duration as berth writes it, and reads it back: days, hours,
/// minutes, seconds and what is below (`365d`, `1d 2h`, `5m 30s`,
/// `1s 500ms`, `0s`). Never months or years, whose length a reader must
/// guess (a year of days read `11months 30days 3h 50m 24s`).
pub fn format_duration(d: Duration) -> String {
    let secs = d.as_secs();
    let nanos = d.subsec_nanos();
    let parts = [
        (secs / 86_400, "d"),
        (secs / 3_600 % 24, "h"),
        (secs / 60 % 60, "m"),
        (secs % 60, "s"),
        (u64::from(nanos / 1_000_000), "ms"),
        (u64::from(nanos / 1_000 % 1_000), "us"),
        (u64::from(nanos % 1_000), "ns"),
    ];
    let out: Vec<String> = parts
        .iter()
        .filter(|(n, _)| *n > 0)
        .map(|(n, unit)| format!("{n}{unit}"))
        .collect();
    if out.is_empty() {
        "0s".into()
    } else {
        out.join(" ")
    }
}

/// Parses `2GiB`, `512MiB`, `1.5GB`, `4096`: binary (`KiB`, `MiB`, `GiB`,
/// `TiB`) and decimal (`KB`, `MB`, `GB`, `TB`) units; a bare number is bytes.
pub fn parse_bytes(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let number: f64 = number
        .parse()
        .map_err(|_| format!("`{text}` is not a size; try 2GiB, 512MiB"))?;
    let factor: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kib" => 1024.0,
        "m" | "mib" => 1024.0 * 1024.0,
        "g" | "gib" => 1024.0 * 1024.0 * 1024.0,
        "t" | "tib" => 1024.0 * 1024.0 * 1024.0 * 1024.0,
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "tb" => 1e12,
        other => {
            return Err(format!(
                "`{text}`: unknown size unit `{other}`; use KiB, MiB, GiB, KB, MB, GB"
            ));
        }
    };
    if !number.is_finite() || number < 0.0 {
        return Err(format!("`{text}` is not a size"));
    }
    Ok((number * factor).round() as u64)
}

/// Bytes as MiB with one decimal (`1024.0 MiB`): how every report, error
/// and CLI line writes a size.
pub fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1024.0 * 1024.0))
}

/// Bytes as GiB with one decimal, for device memory (`20.0 GiB`).
pub fn gib(bytes: u64) -> String {
    format!("{:.1} GiB", bytes as f64 / (1u64 << 30) as f64)
}

/// Serde for `Option<Duration>` as a human string (or a number of seconds).
pub(crate) mod duration_opt {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Raw {
        Text(String),
        Secs(f64),
    }

    pub fn serialize<S: Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
        match d {
            Some(d) => s.serialize_str(&super::format_duration(*d)),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
        match Option::<Raw>::deserialize(d)? {
            None => Ok(None),
            Some(Raw::Text(t)) => super::parse_duration(&t)
                .map(Some)
                .map_err(serde::de::Error::custom),
            Some(Raw::Secs(s)) => super::parse_duration(&s.to_string())
                .map(Some)
                .map_err(serde::de::Error::custom),
        }
    }
}

/// Serde for `Option<u64>` bytes as a human string (or a number of bytes).
pub(crate) mod bytes_opt {
    use serde::{Deserialize, Deserializer, Serializer};

    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Raw {
        Text(String),
        Bytes(u64),
        /// A negative or fractional number: refused with a clear message.
        Number(f64),
    }

    pub fn serialize<S: Serializer>(b: &Option<u64>, s: S) -> Result<S::Ok, S::Error> {
        match b {
            Some(b) => s.serialize_u64(*b),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
        match Option::<Raw>::deserialize(d)? {
            None => Ok(None),
            Some(Raw::Text(t)) => super::parse_bytes(&t)
                .map(Some)
                .map_err(serde::de::Error::custom),
            Some(Raw::Bytes(b)) => Ok(Some(b)),
            Some(Raw::Number(n)) => Err(serde::de::Error::custom(format!(
                "`{n}` is not a size (a whole number of bytes from 0, or 2GiB, 512MiB)"
            ))),
        }
    }
}

/// Deserialises a table of options whose values may be strings, numbers or
/// booleans (as TOML and JSON write them) into strings, the form backends take.
pub(crate) fn scalar_map<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> Result<std::collections::BTreeMap<String, String>, D::Error> {
    use serde::Deserialize;

    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Scalar {
        Text(String),
        Int(i64),
        Float(f64),
        Bool(bool),
    }
    let raw = std::collections::BTreeMap::<String, Scalar>::deserialize(d)?;
    Ok(raw
        .into_iter()
        .map(|(k, v)| {
            let v = match v {
                Scalar::Text(s) => s,
                Scalar::Int(i) => i.to_string(),
                Scalar::Float(f) => f.to_string(),
                Scalar::Bool(b) => b.to_string(),
            };
            (k, v)
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_take_bare_seconds_and_units() {
        assert_eq!(parse_duration("120").unwrap(), Duration::from_secs(120));
        assert_eq!(parse_duration("2s").unwrap(), Duration::from_secs(2));
        assert_eq!(parse_duration("5m").unwrap(), Duration::from_secs(300));
        assert_eq!(parse_duration("500ms").unwrap(), Duration::from_millis(500));
        assert!(parse_duration("soon").unwrap_err().contains("soon"));
        assert!(parse_duration("-1").is_err());
        assert!(parse_duration("1e20").is_err());
        assert!(parse_duration("NaN").is_err());
        assert!(parse_duration("inf").is_err());
    }

    #[test]
    fn durations_are_written_in_units_read_back() {
        let year = Duration::from_secs(365 * 86_400);
        assert_eq!(format_duration(year), "365d");
        assert_eq!(format_duration(Duration::from_millis(1500)), "1s 500ms");
        assert_eq!(format_duration(Duration::ZERO), "0s");
        for d in [
            year,
            Duration::from_secs(90_061),
            Duration::from_nanos(1_000_001_001),
            Duration::from_millis(1),
        ] {
            assert_eq!(parse_duration(&format_duration(d)).unwrap(), d);
        }
    }

    #[test]
    fn sizes_take_binary_and_decimal_units() {
        assert_eq!(parse_bytes("2GiB").unwrap(), 2 << 30);
        assert_eq!(parse_bytes("512 MiB").unwrap(), 512 << 20);
        assert_eq!(parse_bytes("1.5GB").unwrap(), 1_500_000_000);
        assert_eq!(parse_bytes("4096").unwrap(), 4096);
        assert!(parse_bytes("lots").is_err());
        assert!(parse_bytes("3 parsecs").unwrap_err().contains("parsecs"));
    }
}
