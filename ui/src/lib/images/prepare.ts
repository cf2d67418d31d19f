// Turns a dropped, pasted or picked file into an attachment (browser APIs; the decisions are in plan.ts).

import { newId, type ImageAttachment } from '../chat/model';
import { isHeic, planImage, sniffMime } from './plan';

/** A picture that cannot be attached, with a message meant for the user. */
export class ImageError extends Error {
  constructor(message: string) {
    super(message);
    this.name = 'ImageError';
  }
}

function base64(bytes: Uint8Array): string {
  let binary = '';
  // In slices: String.fromCharCode(...all) overflows the call stack on big pictures.
  for (let i = 0; i < bytes.length; i += 0x8000) binary += String.fromCharCode(...bytes.subarray(i, i + 0x8000));
  return btoa(binary);
}

async function decode(file: Blob, heic: boolean, name: string): Promise<ImageBitmap> {
  try {
    // Applies EXIF orientation, so sizes and re-encoded pixels are upright.
    return await createImageBitmap(file);
  } catch {
    throw new ImageError(
      heic
        ? `${name}: this browser cannot decode HEIC pictures. Convert it to JPEG or PNG first (on a Mac: open it in Preview, File › Export).`
        : `${name}: not a picture this browser can read.`,
    );
  }
}

async function encode(bitmap: ImageBitmap, width: number, height: number, mime: string): Promise<Blob> {
  const canvas = document.createElement('canvas');
  canvas.width = width;
  canvas.height = height;
  const context = canvas.getContext('2d');
  if (!context) throw new ImageError('the browser has no 2D canvas to resize the picture');
  context.imageSmoothingQuality = 'high';
  context.drawImage(bitmap, 0, 0, width, height);
  const blob = await new Promise<Blob | null>((resolve) => canvas.toBlob(resolve, mime, 0.92));
  if (!blob) throw new ImageError('the browser could not encode the resized picture');
  return blob;
}

export async function prepareImage(file: File, pixelBudget: number): Promise<ImageAttachment> {
  const name = file.name || 'pasted image';
  const bytes = new Uint8Array(await file.arrayBuffer());
  const mime = sniffMime(bytes) ?? file.type;
  const heic = isHeic(mime, name);
  if (!mime.startsWith('image/') && !heic) throw new ImageError(`${name}: not a picture.`);
  const bitmap = await decode(file, heic, name);
  try {
    const { width, height } = bitmap;
    const plan = planImage({ mime: heic ? 'image/heic' : mime, width, height }, pixelBudget);
    if (plan.action === 'keep') {
      return { id: newId('img'), name, mime, width, height, dataUrl: `data:${mime};base64,${base64(bytes)}` };
    }
    const blob = await encode(bitmap, plan.width, plan.height, plan.mime);
    const encoded = new Uint8Array(await blob.arrayBuffer());
    return {
      id: newId('img'),
      name,
      mime: plan.mime,
      width: plan.width,
      height: plan.height,
      dataUrl: `data:${plan.mime};base64,${base64(encoded)}`,
      ...(plan.reason === 'budget' ? { downscaledFrom: { width, height } } : {}),
    };
  } finally {
    bitmap.close();
  }
}

/** The image files among dropped or pasted items. */
export function imageFiles(list: FileList | File[] | null | undefined): File[] {
  return Array.from(list ?? []).filter((file) => file.type.startsWith('image/') || /\.(hei[cf]|png|jpe?g|webp|gif|bmp|tiff?)$/i.test(file.name));
}
