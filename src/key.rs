//! [`Key`]: the name of a value in the store, and [`IntoKey`]: what names one.

use std::fmt;

use crate::{Error, Result};

/// A key: an `i32` (MXNet's C `int`) or a string, never both in one store; see [`IntoKey`].
///
/// ```
/// use kvstore::Key;
/// assert_eq!(Key::from(3), Key::Int(3));
/// assert_eq!(Key::from("w"), Key::Str("w".into()));
/// assert_eq!(Key::from(3).to_string(), "3");
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Key {
    /// An integer key.
    Int(i32),
    /// A string key.
    Str(String),
}

/// Which kind of key a store holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeyKind {
    /// Integer keys.
    Int,
    /// String keys.
    Str,
}

impl Key {
    /// Whether this key is an int or a string.
    pub fn kind(&self) -> KeyKind {
        match self {
            Key::Int(_) => KeyKind::Int,
            Key::Str(_) => KeyKind::Str,
        }
    }
}

/// `From` for the types that name a key with no range to check, and their [`IntoKey`].
macro_rules! key_from {
    ($($t:ty => |$k:ident| $key:expr),* ; $($into:ty),*) => {
        $(impl From<$t> for Key {
            fn from($k: $t) -> Key {
                $key
            }
        })*
        $(impl IntoKey for $into {
            fn into_key(self) -> Result<Key> {
                Ok(Key::from(self))
            }
        })*
    };
}

key_from!(
    i32 => |k| Key::Int(k),
    &i32 => |k| Key::Int(*k),
    &str => |k| Key::Str(k.to_owned()),
    String => |k| Key::Str(k),
    &String => |k| Key::Str(k.clone()),
    &Key => |k| k.clone();
    &str, String, &String, &Key
);

/// What names a key: [`Key`], `&Key`, `&str`, `String`, `&String`, and every integer type and
/// reference to one, whose value must fit in an `i32` ([`Error::KeyOutOfRange`], never wrapped).
///
/// ```
/// use kvstore::{Error, IntoKey, Key};
/// assert_eq!(7usize.into_key()?, Key::Int(7));
/// assert_eq!((-2i64).into_key()?, Key::Int(-2));
/// assert_eq!("w".into_key()?, Key::from("w"));
/// assert!(matches!(3_000_000_000u64.into_key(), Err(Error::KeyOutOfRange { .. })));
/// # Ok::<(), kvstore::Error>(())
/// ```
pub trait IntoKey {
    /// The key, or [`Error::KeyOutOfRange`] for an integer outside the `i32` range.
    fn into_key(self) -> Result<Key>;
}

impl IntoKey for Key {
    fn into_key(self) -> Result<Key> {
        Ok(self)
    }
}

macro_rules! int_keys {
    ($($t:ty),*) => {$(
        impl IntoKey for $t {
            fn into_key(self) -> Result<Key> {
                i32::try_from(self).map(Key::Int).map_err(|_| Error::KeyOutOfRange {
                    value: self.to_string(),
                    ty: stringify!($t),
                })
            }
        }

        impl IntoKey for &$t {
            fn into_key(self) -> Result<Key> {
                (*self).into_key()
            }
        }
    )*};
}

int_keys!(i8, i16, i32, i64, isize, u8, u16, u32, u64, usize);

impl fmt::Display for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Key::Int(k) => write!(f, "{k}"),
            Key::Str(k) => f.write_str(k),
        }
    }
}

impl fmt::Display for KeyKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            KeyKind::Int => "int",
            KeyKind::Str => "string",
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn int_keys_convert_exactly_or_name_the_value_and_range() {
        assert_eq!(0u8.into_key().unwrap(), Key::Int(0));
        assert_eq!(i32::MAX.into_key().unwrap(), Key::Int(i32::MAX));
        assert_eq!(i64::from(i32::MIN).into_key().unwrap(), Key::Int(i32::MIN));
        assert_eq!((i32::MAX as usize).into_key().unwrap(), Key::Int(i32::MAX));
        assert_eq!((&-5isize).into_key().unwrap(), Key::Int(-5));
        let too_big = i64::from(i32::MAX) + 1;
        for (e, value, ty) in [
            (too_big.into_key().unwrap_err(), too_big.to_string(), "i64"),
            (
                (i32::MAX as u32 + 1).into_key().unwrap_err(),
                "2147483648".into(),
                "u32",
            ),
            (
                usize::MAX.into_key().unwrap_err(),
                usize::MAX.to_string(),
                "usize",
            ),
            (
                (i64::MIN).into_key().unwrap_err(),
                i64::MIN.to_string(),
                "i64",
            ),
        ] {
            assert!(
                matches!(&e, Error::KeyOutOfRange { value: v, ty: t } if *v == value && *t == ty),
                "{e:?}"
            );
            let text = e.to_string();
            assert!(
                text.contains(&value) && text.contains("-2147483648..=2147483647"),
                "{text}"
            );
        }
    }
}
