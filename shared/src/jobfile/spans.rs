//! Where things are in a job file's text: the line of a field, and the field at a byte (from
//! the spanned TOML document, as much of it as parses), for messages that name both.

use std::ops::Range;

use toml::Spanned;
use toml::de::{DeTable, DeValue};

/// The 1-based line of `field` (dotted: `data.train`) in a job file's `text`, if it is there.
pub fn line_of(text: &str, field: &str) -> Option<usize> {
    let (root, _) = DeTable::parse_recoverable(text);
    let mut parts = field.split('.');
    let first = parts.next()?;
    let (mut key, mut value) = root.get_ref().get_key_value(first)?;
    for part in parts {
        let DeValue::Table(t) = value.get_ref() else {
            return None;
        };
        (key, value) = t.get_key_value(part)?;
    }
    Some(line_at(text, key.span().start))
}

/// The 1-based line holding byte `offset` of `text`.
pub(super) fn line_at(text: &str, offset: usize) -> usize {
    let end = offset.min(text.len());
    text.as_bytes()[..end]
        .iter()
        .filter(|&&b| b == b'\n')
        .count()
        + 1
}

/// The dotted path of the innermost key or value whose span holds byte `offset`, found in the
/// spanned document (as much of it as parses).
pub(super) fn field_at(text: &str, offset: usize) -> Option<String> {
    let (root, _) = DeTable::parse_recoverable(text);
    let mut best: Option<(usize, String)> = None;
    visit_table(root.get_ref(), "", offset, &mut best);
    best.map(|(_, path)| path)
}

fn consider(span: Range<usize>, path: &str, offset: usize, best: &mut Option<(usize, String)>) {
    let holds = span.contains(&offset) || (span.is_empty() && span.start == offset);
    if holds && best.as_ref().is_none_or(|(len, _)| span.len() <= *len) {
        *best = Some((span.len(), path.to_owned()));
    }
}

fn visit_table(t: &DeTable<'_>, prefix: &str, offset: usize, best: &mut Option<(usize, String)>) {
    for (k, v) in t.iter() {
        let path = if prefix.is_empty() {
            k.get_ref().to_string()
        } else {
            format!("{prefix}.{}", k.get_ref())
        };
        consider(k.span(), &path, offset, best);
        consider(v.span(), &path, offset, best);
        visit_value(v, &path, offset, best);
    }
}

fn visit_value(
    v: &Spanned<DeValue<'_>>,
    path: &str,
    offset: usize,
    best: &mut Option<(usize, String)>,
) {
    match v.get_ref() {
        DeValue::Table(t) => visit_table(t, path, offset, best),
        DeValue::Array(items) => {
            for (i, item) in items.iter().enumerate() {
                let path = format!("{path}[{i}]");
                consider(item.span(), &path, offset, best);
                visit_value(item, &path, offset, best);
            }
        }
        _ => {}
    }
}
