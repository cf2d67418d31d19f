// What to do with a picture before it goes to the model. Pure decisions, tested on their own:
// the original bytes are sent unless the picture is over the pixel budget or in a format the
// server cannot decode (then it is re-encoded in the browser).

/** 4096 x 4096. Larger pictures cost memory and time in the vision tower for no gain. */
export const DEFAULT_PIXEL_BUDGET = 16_777_216;

/** What `rmlx serve` decodes (docs/SERVER.md): anything else is converted first. */
export const SERVER_FORMATS = new Set(['image/png', 'image/jpeg', 'image/webp', 'image/gif', 'image/bmp', 'image/tiff']);

export type ImagePlan =
  | { action: 'keep' }
  /** Re-encode at this size: over budget, or a format the server cannot read (then same size). */
  | { action: 'reencode'; width: number; height: number; mime: 'image/png' | 'image/jpeg'; reason: 'budget' | 'format' };

export function fitToBudget(width: number, height: number, budget: number): { width: number; height: number } {
  if (width * height <= budget) return { width, height };
  const scale = Math.sqrt(budget / (width * height));
  let w = Math.max(1, Math.floor(width * scale));
  let h = Math.max(1, Math.floor(height * scale));
  // Floating point can land one pixel over; shave the longer side until it fits.
  while (w * h > budget) {
    if (w >= h) w--;
    else h--;
  }
  return { width: w, height: h };
}

export function planImage(image: { mime: string; width: number; height: number }, budget = DEFAULT_PIXEL_BUDGET): ImagePlan {
  const overBudget = image.width * image.height > budget;
  const readable = SERVER_FORMATS.has(image.mime);
  if (readable && !overBudget) return { action: 'keep' };
  // Photos stay JPEG (small); everything else becomes lossless PNG.
  const mime = image.mime === 'image/jpeg' ? 'image/jpeg' : 'image/png';
  const size = fitToBudget(image.width, image.height, budget);
  return { action: 'reencode', ...size, mime, reason: overBudget ? 'budget' : 'format' };
}

/** The format from the file's first bytes; clipboard and drag sources often give no type. */
export function sniffMime(bytes: Uint8Array): string | null {
  const ascii = (start: number, end: number) => String.fromCharCode(...bytes.subarray(start, end));
  if (bytes.length >= 8 && bytes[0] === 0x89 && ascii(1, 4) === 'PNG') return 'image/png';
  if (bytes.length >= 3 && bytes[0] === 0xff && bytes[1] === 0xd8 && bytes[2] === 0xff) return 'image/jpeg';
  if (bytes.length >= 6 && ascii(0, 4) === 'GIF8') return 'image/gif';
  if (bytes.length >= 12 && ascii(0, 4) === 'RIFF' && ascii(8, 12) === 'WEBP') return 'image/webp';
  if (bytes.length >= 2 && ascii(0, 2) === 'BM') return 'image/bmp';
  if (bytes.length >= 4 && (ascii(0, 4) === 'II*\0' || ascii(0, 4) === 'MM\0*')) return 'image/tiff';
  if (bytes.length >= 12 && ascii(4, 8) === 'ftyp') {
    const brand = ascii(8, 12);
    if (['heic', 'heix', 'hevc', 'hevx', 'heim', 'heis', 'mif1', 'msf1'].includes(brand)) return 'image/heic';
    if (brand === 'avif' || brand === 'avis') return 'image/avif';
  }
  return null;
}

export function isHeic(mime: string | null, name: string): boolean {
  return mime === 'image/heic' || mime === 'image/heif' || /\.hei[cf]$/i.test(name);
}
